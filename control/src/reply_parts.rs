//! A [`SnapshotReply`] too large for one bus message, sent in parts (docs/control-plane.md,
//! "NATS: resync"): each part is a reply of the same kind and `last_seq` holding a run of the
//! events (or batches), with `"part": i, "parts": n` beside them; the receiver joins them in
//! order. A reply that fits goes out whole, without those fields, as before.
//!
//! A snapshot always splits: a Stored chain too long for one part is cut into chains that
//! continue each other. Replayed batches are never cut (a batch is one sequence number);
//! a replay with a batch too large for a part is refused, and the agent sends a snapshot.

use bytes::Bytes;
use kvmesh_kv::{BlockParent, KvEvent};
use serde::Deserialize;

use crate::error::ControlError;
use crate::events::RankedEvent;
use crate::resync::SnapshotReply;

/// Bytes of each part kept for its own fields (`kind`, `last_seq`, `part`, `parts`).
const PART_OVERHEAD: usize = 160;

/// The part fields of a reply (absent on a whole reply: part 0 of 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
struct PartHeader {
    #[serde(default)]
    part: u32,
    #[serde(default = "one")]
    parts: u32,
}

fn one() -> u32 {
    1
}

/// The reply as messages of at most `max_bytes` each: one (the whole reply) when it fits.
/// Fails with [`ControlError::PayloadTooLarge`] for replayed batches that do not fit a part
/// (ask for a snapshot instead), or a limit too small for a single block.
pub fn reply_parts(reply: &SnapshotReply, max_bytes: usize) -> Result<Vec<Bytes>, ControlError> {
    let whole = reply.to_json();
    if whole.len() <= max_bytes {
        return Ok(vec![Bytes::from(whole)]);
    }
    let too_large = |size: usize| ControlError::PayloadTooLarge {
        size,
        limit: max_bytes,
    };
    let budget = max_bytes
        .checked_sub(PART_OVERHEAD)
        .ok_or(too_large(whole.len()))?;
    let (kind, field, items, last_seq) = match reply {
        SnapshotReply::Events { batches, last_seq } => {
            let items = batches
                .iter()
                .map(serde_json::to_vec)
                .collect::<Result<Vec<_>, _>>()?;
            ("events", "batches", items, *last_seq)
        }
        SnapshotReply::Snapshot { events, last_seq } => {
            let mut items = Vec::with_capacity(events.len());
            for event in events {
                for piece in fitting_pieces(event, budget)? {
                    items.push(serde_json::to_vec(&piece)?);
                }
            }
            ("snapshot", "events", items, *last_seq)
        }
    };
    if let Some(item) = items.iter().find(|item| item.len() > budget) {
        return Err(too_large(item.len()));
    }
    let mut runs: Vec<Vec<Vec<u8>>> = Vec::new();
    let mut size = 0;
    for item in items {
        match runs.last_mut() {
            Some(run) if size + item.len() < budget => {
                size += item.len() + 1;
                run.push(item);
            }
            _ => {
                size = item.len() + 1;
                runs.push(vec![item]);
            }
        }
    }
    let parts = runs.len();
    Ok(runs
        .into_iter()
        .enumerate()
        .map(|(part, run)| {
            let mut json = format!("{{\"kind\":\"{kind}\",\"{field}\":[").into_bytes();
            for (i, item) in run.iter().enumerate() {
                if i > 0 {
                    json.push(b',');
                }
                json.extend_from_slice(item);
            }
            json.extend_from_slice(
                format!("],\"last_seq\":{last_seq},\"part\":{part},\"parts\":{parts}}}").as_bytes(),
            );
            Bytes::from(json)
        })
        .collect())
}

/// `event` as it is when its JSON fits `budget`; a Stored chain that does not, cut into
/// consecutive chains (each the child of the one before) that do.
fn fitting_pieces(event: &RankedEvent, budget: usize) -> Result<Vec<RankedEvent>, ControlError> {
    let size = serde_json::to_vec(event)?.len();
    let KvEvent::Stored { parent, blocks } = &event.event else {
        return Ok(vec![event.clone()]);
    };
    if size <= budget || blocks.len() < 2 {
        return Ok(vec![event.clone()]);
    }
    // Blocks per piece from the average block's size, with a tenth to spare.
    let per_block = size.div_ceil(blocks.len());
    let mut per_piece = (budget * 9 / 10 / per_block).max(1);
    loop {
        let mut pieces = Vec::with_capacity(blocks.len().div_ceil(per_piece));
        let mut previous = *parent;
        for chunk in blocks.chunks(per_piece) {
            pieces.push(RankedEvent {
                dp_rank: event.dp_rank,
                tier: event.tier,
                event: KvEvent::Stored {
                    parent: previous,
                    blocks: chunk.to_vec(),
                },
            });
            previous = chunk.last().map(|block| BlockParent {
                external: block.external,
                sequence: block.sequence,
            });
        }
        let fits = pieces
            .iter()
            .map(|piece| serde_json::to_vec(piece).map(|json| json.len() <= budget))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .all(|fits| fits);
        if fits || per_piece == 1 {
            return Ok(pieces);
        }
        per_piece /= 2;
    }
}

/// One part of a reply, checked to follow the part before it: a reply of the same kind and
/// `last_seq` holding its run of the events (or batches).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplyPart {
    /// This part's run, as a reply of its own.
    pub reply: SnapshotReply,
    /// Its position, from 0.
    pub index: u32,
    /// How many parts the reply has.
    pub parts: u32,
}

impl ReplyPart {
    /// A reply that came whole: part 0 of 1.
    pub fn whole(reply: SnapshotReply) -> Self {
        Self {
            reply,
            index: 0,
            parts: 1,
        }
    }

    /// Whether this is the reply's first part (a snapshot's receiver clears here).
    pub fn is_first(&self) -> bool {
        self.index == 0
    }

    /// Whether this is the reply's last part (the reply is complete with it).
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.parts
    }
}

/// Checks the parts of one reply as they arrive, so that each can be applied before the
/// next is read, or joins them ([`ReplyAssembler::push`]).
#[derive(Debug, Default)]
pub struct ReplyAssembler {
    /// The first part's kind (`true`: snapshot) and `last_seq`, once it is in.
    first: Option<(bool, u64)>,
    next_part: u32,
    parts: u32,
    joined: Option<SnapshotReply>,
}

impl ReplyAssembler {
    /// An assembler waiting for part 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads the next message of the reply; an error for a part that is unreadable, out of
    /// order, past the last, or of another reply (kind or `last_seq` differ).
    pub fn next_part(&mut self, message: &[u8]) -> Result<ReplyPart, ControlError> {
        let header: PartHeader = serde_json::from_slice(message)?;
        let reply = SnapshotReply::from_json(message)?;
        let complete = self.next_part > 0 && self.next_part == self.parts;
        let expected_parts = if self.next_part == 0 {
            header.parts
        } else {
            self.parts
        };
        if complete
            || header.part != self.next_part
            || header.parts != expected_parts
            || header.parts == 0
        {
            return Err(ControlError::Protocol(format!(
                "reply part {} of {} where part {} of {expected_parts} was due",
                header.part, header.parts, self.next_part
            )));
        }
        let identity = (
            matches!(reply, SnapshotReply::Snapshot { .. }),
            reply.last_seq(),
        );
        if *self.first.get_or_insert(identity) != identity {
            return Err(ControlError::Protocol(
                "the parts of a reply differ in kind or last_seq".to_owned(),
            ));
        }
        self.parts = header.parts;
        self.next_part += 1;
        Ok(ReplyPart {
            reply,
            index: header.part,
            parts: header.parts,
        })
    }

    /// Takes the next message of the reply and joins it to those before: `Ok(Some(reply))`
    /// once every part is in, `Ok(None)` while parts are missing; errors as
    /// [`ReplyAssembler::next_part`].
    pub fn push(&mut self, message: &[u8]) -> Result<Option<SnapshotReply>, ControlError> {
        let part = self.next_part(message)?;
        let last = part.is_last();
        let joined = match (self.joined.take(), part.reply) {
            (None, reply) => reply,
            (
                Some(SnapshotReply::Events {
                    mut batches,
                    last_seq,
                }),
                SnapshotReply::Events { batches: more, .. },
            ) => {
                batches.extend(more);
                SnapshotReply::Events { batches, last_seq }
            }
            (
                Some(SnapshotReply::Snapshot {
                    mut events,
                    last_seq,
                }),
                SnapshotReply::Snapshot { events: more, .. },
            ) => {
                events.extend(more);
                SnapshotReply::Snapshot { events, last_seq }
            }
            _ => {
                return Err(ControlError::Protocol(
                    "the parts of a reply differ in kind".to_owned(),
                ));
            }
        };
        if last {
            return Ok(Some(joined));
        }
        self.joined = Some(joined);
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_kv::{ExternalHash, LocalBlockHash};

    use super::*;
    use crate::events::EventBatch;
    use crate::ids::InstanceId;

    fn chain(start: u64, len: u64, dp_rank: u32) -> RankedEvent {
        RankedEvent {
            dp_rank,
            tier: Default::default(),
            event: KvEvent::stored(
                None,
                (start..start + len).map(|i| (ExternalHash(i), LocalBlockHash(i * 7))),
            ),
        }
    }

    fn join(parts: &[Bytes]) -> SnapshotReply {
        let mut assembler = ReplyAssembler::new();
        let (last, rest) = parts.split_last().expect("a part");
        for part in rest {
            assert_eq!(assembler.push(part).expect("part"), None);
        }
        assembler.push(last).expect("last part").expect("whole")
    }

    /// Every block of `reply` as (rank, sequence hash, parent's sequence hash).
    fn blocks(reply: &SnapshotReply) -> Vec<(u32, u64, Option<u64>)> {
        let SnapshotReply::Snapshot { events, .. } = reply else {
            panic!("a snapshot");
        };
        let mut out = Vec::new();
        for event in events {
            if let KvEvent::Stored { parent, blocks } = &event.event {
                let mut previous = parent.map(|p| p.sequence.0);
                for block in blocks {
                    out.push((event.dp_rank, block.sequence.0, previous));
                    previous = Some(block.sequence.0);
                }
            }
        }
        out
    }

    #[test]
    fn a_reply_that_fits_goes_out_whole_and_reads_back() {
        let reply = SnapshotReply::Snapshot {
            events: vec![chain(1, 3, 0)],
            last_seq: 4,
        };
        let parts = reply_parts(&reply, 1 << 20).expect("parts");
        assert_eq!(parts, vec![Bytes::from(reply.to_json())]);
        assert_eq!(join(&parts), reply);
    }

    #[test]
    fn a_100k_block_snapshot_fits_a_1_mib_limit_in_parts() {
        // Chains of 6,000 blocks (a 96k-token prompt at 16 tokens a block) on two ranks.
        let events: Vec<RankedEvent> = (0..17)
            .map(|i| chain(i * 10_000, 6_000, (i % 2) as u32))
            .collect();
        let reply = SnapshotReply::Snapshot {
            events,
            last_seq: 99,
        };
        let limit = 1 << 20;
        assert!(reply.to_json().len() > 5 * limit);
        let parts = reply_parts(&reply, limit).expect("parts");
        assert!(parts.len() > 5, "{} parts", parts.len());
        assert!(parts.iter().all(|part| part.len() <= limit));
        let joined = join(&parts);
        assert_eq!(joined.last_seq(), 99);
        // The same blocks, in the same order, each under the same parent.
        assert_eq!(blocks(&joined), blocks(&reply));
        assert_eq!(blocks(&joined).len(), 102_000);
    }

    #[test]
    fn one_chain_longer_than_a_part_is_cut_into_chains_that_continue_each_other() {
        let reply = SnapshotReply::Snapshot {
            events: vec![chain(1, 2_000, 3)],
            last_seq: 1,
        };
        let parts = reply_parts(&reply, 16 * 1024).expect("parts");
        assert!(parts.len() > 10);
        assert!(parts.iter().all(|part| part.len() <= 16 * 1024));
        assert_eq!(blocks(&join(&parts)), blocks(&reply));
    }

    #[test]
    fn replays_split_between_batches_and_refuse_a_batch_that_does_not_fit() {
        let batch = |seq: u64, len: u64| EventBatch {
            instance_id: InstanceId(5),
            dp_rank: 0,
            tier: Default::default(),
            seq,
            events: vec![chain(seq * 1000, len, 0).event],
        };
        let reply = SnapshotReply::Events {
            batches: (1..=40).map(|seq| batch(seq, 20)).collect(),
            last_seq: 40,
        };
        let parts = reply_parts(&reply, 16 * 1024).expect("parts");
        assert!(parts.len() > 1);
        assert_eq!(join(&parts), reply);
        let huge = SnapshotReply::Events {
            batches: vec![batch(1, 2_000)],
            last_seq: 1,
        };
        assert!(matches!(
            reply_parts(&huge, 16 * 1024),
            Err(ControlError::PayloadTooLarge { .. })
        ));
    }

    #[test]
    fn parts_are_read_one_by_one_with_their_place_and_none_past_the_last() {
        let reply = SnapshotReply::Snapshot {
            events: (0..50).map(|i| chain(i * 100, 20, 0)).collect(),
            last_seq: 7,
        };
        let parts = reply_parts(&reply, 16 * 1024).expect("parts");
        let count = u32::try_from(parts.len()).expect("few parts");
        assert!(count >= 3);
        let mut assembler = ReplyAssembler::new();
        let mut events = Vec::new();
        for (i, message) in parts.iter().enumerate() {
            let part = assembler.next_part(message).expect("part");
            assert_eq!((part.index as usize, part.parts), (i, count));
            assert_eq!(part.is_first(), i == 0);
            assert_eq!(part.is_last(), i + 1 == parts.len());
            let SnapshotReply::Snapshot {
                events: run,
                last_seq,
            } = part.reply
            else {
                panic!("a snapshot part");
            };
            assert_eq!(last_seq, 7);
            events.extend(run);
        }
        let rejoined = SnapshotReply::Snapshot {
            events,
            last_seq: 7,
        };
        assert_eq!(blocks(&rejoined), blocks(&reply));
        assert!(assembler.next_part(&parts[0]).is_err());
    }

    #[test]
    fn parts_out_of_order_or_of_another_reply_are_refused() {
        let reply = SnapshotReply::Snapshot {
            events: (0..50).map(|i| chain(i * 100, 20, 0)).collect(),
            last_seq: 7,
        };
        let parts = reply_parts(&reply, 16 * 1024).expect("parts");
        assert!(parts.len() >= 3);
        assert!(ReplyAssembler::new().push(&parts[1]).is_err());
        let mut assembler = ReplyAssembler::new();
        assembler.push(&parts[0]).expect("first");
        assert!(assembler.push(&parts[2]).is_err());
        let other = SnapshotReply::Snapshot {
            events: (0..50).map(|i| chain(i * 100, 20, 0)).collect(),
            last_seq: 8,
        };
        let other_parts = reply_parts(&other, 16 * 1024).expect("parts");
        let mut assembler = ReplyAssembler::new();
        assembler.push(&parts[0]).expect("first");
        assert!(assembler.push(&other_parts[1]).is_err());
    }
}
