//! The synthetic multi-turn chat workload: sessions that share system prompts and grow turn by
//! turn, arriving as a Poisson process.
//!
//! Model: `sessions` conversations of `turns` user turns each. Session `s` opens with system
//! prompt `s mod system_prompts` (so sessions share prefixes of `system_words` words). Requests
//! arrive as a Poisson process at `rate` per second; each arrival is the next turn of one of
//! the `active_sessions` open conversations, drawn uniformly; a conversation that has sent its
//! last turn is replaced by the next unopened one. Turn `k` carries the whole conversation so
//! far: the system prompt, the user messages of turns `1..=k` and, between them, a synthetic
//! assistant answer of `answer_words` words for each earlier turn (not the engine's actual
//! output, which the generator does not wait for; the prefix up to the previous user message
//! is therefore what a cache can reuse, as with a client that rewrites answers). Everything is
//! a function of `seed`.

use std::time::Duration;

use crate::arrival::PoissonArrivals;
use crate::prompt::synthetic_prompt;
use crate::rng::SplitMix64;

/// Parameters of the chat workload.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChatSpec {
    /// Conversations in total.
    pub sessions: usize,
    /// Conversations open at once (the pool each arrival draws from).
    pub active_sessions: usize,
    /// User turns per conversation.
    pub turns: usize,
    /// Distinct system prompts, shared round robin by the conversations.
    pub system_prompts: usize,
    /// Words per system prompt.
    pub system_words: usize,
    /// Words per user message.
    pub user_words: usize,
    /// Words per synthetic assistant answer in the history.
    pub answer_words: usize,
    /// Mean arrival rate of requests, per second.
    pub rate: f64,
    /// Seed of the texts, the arrival gaps and the session draws.
    pub seed: u64,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: &'static str,
    /// The text.
    pub content: String,
}

/// One request of the schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatTurn {
    /// Arrival time from the start of the run.
    pub offset: Duration,
    /// Conversation number.
    pub session: usize,
    /// Turn number within the conversation, from 0.
    pub turn: usize,
    /// The conversation so far, ending with this turn's user message.
    pub messages: Vec<Message>,
}

/// Seeds of the independent text streams, so changing one count never shifts another's text.
const SYSTEM_STREAM: u64 = 0x5157_0000_0000_0000;
const USER_STREAM: u64 = 0x5553_0000_0000_0000;
const ANSWER_STREAM: u64 = 0x414e_0000_0000_0000;

/// The whole schedule, in arrival order (`sessions × turns` requests).
pub fn chat_schedule(spec: &ChatSpec) -> Vec<ChatTurn> {
    let mix = |stream: u64, a: usize, b: usize| {
        SplitMix64::new(spec.seed ^ stream ^ ((a as u64) << 20) ^ b as u64).next_u64()
    };
    let systems: Vec<String> = (0..spec.system_prompts.max(1))
        .map(|k| synthetic_prompt(spec.system_words, mix(SYSTEM_STREAM, k, 0)))
        .collect();
    let mut gaps = PoissonArrivals::new(spec.rate, spec.seed);
    let mut draws = SplitMix64::new(spec.seed ^ 0xd1ce);
    // (session, history) of the open conversations.
    let mut open: Vec<(usize, Vec<Message>)> = Vec::new();
    let mut next_session = 0;
    let mut now = Duration::ZERO;
    let mut out = Vec::with_capacity(spec.sessions * spec.turns);
    if spec.turns == 0 {
        return out;
    }
    loop {
        while open.len() < spec.active_sessions.max(1) && next_session < spec.sessions {
            let system = systems[next_session % systems.len()].clone();
            open.push((
                next_session,
                vec![Message {
                    role: "system",
                    content: system,
                }],
            ));
            next_session += 1;
        }
        if open.is_empty() {
            return out;
        }
        now += gaps.next_gap();
        let slot = draws.next_index(open.len());
        let (session, history) = &mut open[slot];
        let turn = history.len() / 2;
        if turn > 0 {
            history.push(Message {
                role: "assistant",
                content: synthetic_prompt(spec.answer_words, mix(ANSWER_STREAM, *session, turn)),
            });
        }
        history.push(Message {
            role: "user",
            content: synthetic_prompt(spec.user_words, mix(USER_STREAM, *session, turn)),
        });
        out.push(ChatTurn {
            offset: now,
            session: *session,
            turn,
            messages: history.clone(),
        });
        if turn + 1 == spec.turns {
            open.swap_remove(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ChatSpec {
        ChatSpec {
            sessions: 10,
            active_sessions: 3,
            turns: 4,
            system_prompts: 2,
            system_words: 50,
            user_words: 8,
            answer_words: 5,
            rate: 100.0,
            seed: 7,
        }
    }

    #[test]
    fn every_session_sends_every_turn_in_order() {
        let schedule = chat_schedule(&spec());
        assert_eq!(schedule.len(), 40);
        for s in 0..10 {
            let turns: Vec<usize> = schedule
                .iter()
                .filter(|t| t.session == s)
                .map(|t| t.turn)
                .collect();
            assert_eq!(turns, [0, 1, 2, 3], "session {s}");
        }
        assert!(schedule.windows(2).all(|w| w[0].offset <= w[1].offset));
    }

    #[test]
    fn turns_grow_the_previous_turn_and_share_system_prompts() {
        let schedule = chat_schedule(&spec());
        for t in schedule.iter().filter(|t| t.turn > 0) {
            let previous = schedule
                .iter()
                .find(|p| p.session == t.session && p.turn == t.turn - 1)
                .expect("previous turn");
            assert_eq!(t.messages.len(), previous.messages.len() + 2);
            assert_eq!(t.messages[..previous.messages.len()], previous.messages[..]);
            assert_eq!(t.messages[t.messages.len() - 2].role, "assistant");
            assert_eq!(t.messages.last().map(|m| m.role), Some("user"));
        }
        let system = |s: usize| {
            schedule
                .iter()
                .find(|t| t.session == s)
                .map(|t| t.messages[0].content.clone())
                .expect("session")
        };
        assert_eq!(system(0), system(2));
        assert_ne!(system(0), system(1));
        assert_eq!(system(0).split_whitespace().count(), 50);
        let first_users: Vec<String> = (0..3)
            .map(|s| {
                let t = schedule.iter().find(|t| t.session == s).expect("session");
                t.messages[1].content.clone()
            })
            .collect();
        assert_ne!(first_users[0], first_users[2]);
    }

    #[test]
    fn at_most_the_active_sessions_interleave() {
        let schedule = chat_schedule(&spec());
        // A session opens only when fewer than 3 are open, so by the time session s sends its
        // first turn, sessions below s - 3 have finished.
        for (i, t) in schedule.iter().enumerate() {
            if t.turn == 0 && t.session >= 3 {
                let finished_before = schedule[..i]
                    .iter()
                    .filter(|p| p.turn == 3 && p.session < t.session)
                    .count();
                assert!(finished_before >= t.session - 2, "session {}", t.session);
            }
        }
    }

    #[test]
    fn is_deterministic_and_follows_the_rate() {
        let a = chat_schedule(&spec());
        assert_eq!(a, chat_schedule(&spec()));
        let other = chat_schedule(&ChatSpec { seed: 8, ..spec() });
        assert_ne!(a, other);
        let long = chat_schedule(&ChatSpec {
            sessions: 2000,
            ..spec()
        });
        let span = long.last().expect("requests").offset.as_secs_f64();
        let rate = long.len() as f64 / span;
        assert!((rate - 100.0).abs() < 5.0, "rate {rate}");
    }
}
