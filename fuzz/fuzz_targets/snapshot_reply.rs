//! Resync replies as the proxy joins them (`ReplyAssembler`: a reply too large for one NATS
//! message comes in parts), and the agent's side that cuts a reply into parts (`reply_parts`).
//!
//! Input: the messages of one reply, one per line (compact JSON has no raw newline). Whatever
//! they hold: nothing panics; a joined reply writes back to JSON that reads as itself, and cut
//! again into parts of at most some size (a few hundred bytes up to whole), every part within
//! it, joins back to itself.

#![no_main]

use kvmesh_control::{ReplyAssembler, SnapshotReply, reply_parts};
use libfuzzer_sys::fuzz_target;

/// A size limit for the parts, from 200 bytes up, that follows the bytes.
fn limit(data: &[u8]) -> usize {
    let hash = data.iter().fold(0xcbf2_9ce4_8422_2325_u64, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    });
    200 + (hash % 4096) as usize
}

fuzz_target!(|data: &[u8]| {
    let max_bytes = limit(data);
    let mut assembler = ReplyAssembler::new();
    for message in data.split(|&byte| byte == b'\n') {
        let Ok(Some(reply)) = assembler.push(message) else {
            continue;
        };
        assert_eq!(
            SnapshotReply::from_json(&reply.to_json()).ok().as_ref(),
            Some(&reply)
        );
        let Ok(parts) = reply_parts(&reply, max_bytes) else {
            continue;
        };
        let mut again = ReplyAssembler::new();
        let mut joined = None;
        for (i, part) in parts.iter().enumerate() {
            assert!(part.len() <= max_bytes, "part {i}: {} bytes", part.len());
            let pushed = again.push(part).expect("a part the agent cut joins");
            assert_eq!(pushed.is_some(), i + 1 == parts.len(), "part {i}");
            joined = pushed;
        }
        assert_eq!(
            joined.as_ref(),
            Some(&reply),
            "cut into {} parts",
            parts.len()
        );
    }
});
