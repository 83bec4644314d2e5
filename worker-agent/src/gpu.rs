//! The GPUs of the pod (cargo feature `cuda`, off by default): each visible device's free and
//! total memory and its copy bandwidths (page-locked host memory to device, device to host,
//! device to device), measured once at start with cudarc. The agent reports them in its instance record's
//! labels and paces KV transfers at the measured host-to-device rate unless
//! `--pace-rate-gbps` is given.
//!
//! cudarc loads the driver at run time; the probe first checks that the driver library is
//! there (creating a context without it would panic), so a machine without a GPU or driver
//! gets an error, not a crash.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, DriverError};

/// Bytes each copy moves (or a quarter of the free memory, when smaller).
const COPY_BYTES: usize = 256 << 20;
/// Timed copies per direction (after one untimed warm-up).
const COPIES: u32 = 5;

/// What one GPU measured.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuReport {
    /// Device ordinal.
    pub ordinal: usize,
    /// Device name.
    pub name: String,
    /// Free memory, bytes.
    pub free_bytes: usize,
    /// Total memory, bytes.
    pub total_bytes: usize,
    /// Host to device, GB/s (10⁹ bytes).
    pub h2d_gbps: f64,
    /// Device to host, GB/s.
    pub d2h_gbps: f64,
    /// Device to device, GB/s (each byte read and written once).
    pub d2d_gbps: f64,
}

impl GpuReport {
    /// Instance-record labels: `gpu.N.name`, `gpu.N.free_bytes`, `gpu.N.total_bytes`,
    /// `gpu.N.h2d_gbps`, `gpu.N.d2h_gbps`, `gpu.N.d2d_gbps`.
    pub fn labels(&self) -> BTreeMap<String, String> {
        let n = self.ordinal;
        [
            ("name", self.name.clone()),
            ("free_bytes", self.free_bytes.to_string()),
            ("total_bytes", self.total_bytes.to_string()),
            ("h2d_gbps", format!("{:.1}", self.h2d_gbps)),
            ("d2h_gbps", format!("{:.1}", self.d2h_gbps)),
            ("d2d_gbps", format!("{:.1}", self.d2d_gbps)),
        ]
        .into_iter()
        .map(|(key, value)| (format!("gpu.{n}.{key}"), value))
        .collect()
    }
}

/// Measures every visible GPU; `Err` says why nothing could be (no driver, no device).
pub fn probe() -> Result<Vec<GpuReport>, String> {
    // SAFETY: only looks for the driver library; loads nothing into use.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver library (libcuda) found".to_owned());
    }
    let count = CudaContext::device_count().map_err(driver_error)?;
    if count <= 0 {
        return Err("the CUDA driver sees no device".to_owned());
    }
    (0..count as usize)
        .map(|ordinal| measure(ordinal).map_err(driver_error))
        .collect()
}

fn driver_error(error: DriverError) -> String {
    format!("CUDA driver: {error}")
}

fn measure(ordinal: usize) -> Result<GpuReport, DriverError> {
    let context = CudaContext::new(ordinal)?;
    let name = context.name()?;
    let (free_bytes, total_bytes) = context.mem_get_info()?;
    let bytes = COPY_BYTES.min(free_bytes / 4).max(1 << 20);
    let stream = context.default_stream();
    // Page-locked, as KV connectors' staging buffers are: a copy from pageable memory goes
    // through the driver's own bounce buffer and measured 7× slower on an H100 (8 against
    // 55 GB/s host to device, docs/agent.md), which would pace transfers far below the link.
    // SAFETY: plain page-locked memory (no flags); its bytes are set before any copy reads them.
    let mut host = unsafe { context.alloc_pinned_with_flags::<u8>(bytes, 0) }?;
    host.as_mut_slice()?.fill(1);
    let mut device: CudaSlice<u8> = stream.alloc_zeros(bytes)?;
    let mut other: CudaSlice<u8> = stream.alloc_zeros(bytes)?;
    let h2d = timed(|| {
        stream.memcpy_htod(&host, &mut device)?;
        stream.synchronize()
    })?;
    let d2h = timed(|| {
        stream.memcpy_dtoh(&device, &mut host)?;
        stream.synchronize()
    })?;
    let d2d = timed(|| {
        stream.memcpy_dtod(&device, &mut other)?;
        stream.synchronize()
    })?;
    let gbps = |took: Duration| bytes as f64 / took.as_secs_f64().max(1e-9) / 1e9;
    Ok(GpuReport {
        ordinal,
        name,
        free_bytes,
        total_bytes,
        h2d_gbps: gbps(h2d),
        d2h_gbps: gbps(d2h),
        d2d_gbps: gbps(d2d),
    })
}

/// The fastest of [`COPIES`] runs of `copy` after a warm-up.
fn timed(mut copy: impl FnMut() -> Result<(), DriverError>) -> Result<Duration, DriverError> {
    copy()?;
    let mut best = Duration::MAX;
    for _ in 0..COPIES {
        let start = Instant::now();
        copy()?;
        best = best.min(start.elapsed());
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `KVMESH_EXPECT_GPU` set: the machine has a GPU, and an error fails the test.
    #[test]
    fn a_machine_without_a_gpu_gets_an_error_not_a_panic() {
        let result = probe();
        if std::env::var_os("KVMESH_EXPECT_GPU").is_some() {
            assert!(result.is_ok(), "{result:?}");
        }
        match result {
            Ok(reports) => {
                // A GPU machine: every device measured something.
                for report in reports {
                    assert!(
                        report.total_bytes > 0 && report.h2d_gbps > 0.0,
                        "{report:?}"
                    );
                    assert_eq!(report.labels().len(), 6);
                }
            }
            Err(why) => assert!(why.contains("CUDA"), "{why}"),
        }
    }

    #[test]
    fn labels_name_the_device() {
        let report = GpuReport {
            ordinal: 1,
            name: "H100".into(),
            free_bytes: 10,
            total_bytes: 20,
            h2d_gbps: 25.04,
            d2h_gbps: 24.0,
            d2d_gbps: 1500.0,
        };
        let labels = report.labels();
        assert_eq!(labels["gpu.1.name"], "H100");
        assert_eq!(labels["gpu.1.h2d_gbps"], "25.0");
        assert_eq!(labels["gpu.1.total_bytes"], "20");
    }
}
