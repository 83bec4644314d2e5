//! CPU time used by this process, to tell whether the load generator itself was saturated.

use std::time::Duration;

/// Kernel clock ticks per second in `/proc` (USER_HZ, 100 on every mainstream Linux ABI).
const USER_HZ: u64 = 100;

/// User plus system CPU time of this process (all threads) from `/proc/self/stat`; `None`
/// where that file is unavailable (non-Linux).
pub fn process_cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    cpu_time_from_stat(&stat)
}

/// Parses utime + stime out of a `/proc/PID/stat` line.
fn cpu_time_from_stat(stat: &str) -> Option<Duration> {
    // The command name may contain spaces and parentheses: fields resume after the last ')'.
    let after_comm = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_comm.split_whitespace();
    // After the name: state is field 3 of the line, utime field 14, stime field 15.
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(Duration::from_millis((utime + stime) * 1000 / USER_HZ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_stat_line_with_an_awkward_name() {
        let line = "4242 (kvmesh (bench) x) S 1 4242 4242 0 -1 4194304 500 0 0 0 150 25 0 0 20 0 3 0 100 1000000 500 18446744073709551615";
        assert_eq!(cpu_time_from_stat(line), Some(Duration::from_millis(1750)));
    }

    #[test]
    fn rejects_truncated_lines() {
        assert_eq!(cpu_time_from_stat("1 (x) S 1 2"), None);
        assert_eq!(cpu_time_from_stat("garbage"), None);
    }

    #[test]
    fn reads_this_process_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(process_cpu_time().is_some());
        }
    }
}
