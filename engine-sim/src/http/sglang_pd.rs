//! SGLang's disaggregated serving on a request's way (`--disaggregation-mode`): which leg a
//! completions, chat or `/generate` request is, and what it does beside its generation.
//!
//! - A request without `bootstrap_room` is refused as SGLang's scheduler refuses it on a
//!   prefill or decode engine: 400, `Invalid request: Disaggregated request received without
//!   bootstrap room id. req.rid='…'` (sgl-project/sglang
//!   `python/sglang/srt/managers/scheduler.py` at 0003215c, `handle_generate_request`).
//! - **Prefill leg** (`prefill` engine): enters its room and waits up to the bootstrap
//!   timeout for the decode engine to join (SGLang's bootstrap queue), prefills with
//!   `max_tokens` 1 (SGLang sets `max_new_tokens = 1`), holds the prompt's blocks, and
//!   answers (one token, `finish_reason: length`, as SGLang's `FINISH_LENGTH(0)`) once the
//!   decode engine has them (`prefill.py` at 000c2b94).
//! - **Decode leg** (`decode` engine): joins the room on the bootstrap server at
//!   `bootstrap_host:bootstrap_port` (its own `--disaggregation-bootstrap-port` when the leg
//!   has none, as SGLang's scheduler defaults it), waits up to the waiting timeout for the
//!   KV, moves it over its inbound link, and decodes with the prompt computed; its answer
//!   reports the prefill engine's cached tokens, as SGLang's decode engine does (`decode.py`
//!   at 0035ca42).
//!
//! Failures answer 500 with SGLang's messages (`Prefill bootstrap failed …`, `Prefill
//! transfer failed …`, `Decode transfer failed …`).

use std::time::Instant;

use http::StatusCode;
use serde::Deserialize;
use serde_json::Value;
use tokio::sync::mpsc::{self, UnboundedReceiver};

use super::dp_rank::RankChoice;
use super::error::ApiError;
use super::generation::{cached_blocks, parse_json};
use super::state::EngineState;
use crate::config::DisaggregationMode;
use crate::kv_transfer::bootstrap::{ReceiveError, hold_id, receive};
use crate::kv_transfer::rooms::{PrefillSeat, RoomKv};
use crate::lora::Lora;
use crate::protocol::requests::GenParams;
use crate::scheduler::{Handoff, SeqEvent};

/// The bootstrap fields of a leg (SGLang's `GenerateReqInput` and OpenAI requests carry them
/// beside the rest).
#[derive(Debug, Deserialize)]
struct BootstrapFields {
    #[serde(default)]
    bootstrap_host: Option<Value>,
    #[serde(default)]
    bootstrap_port: Option<Value>,
    #[serde(default)]
    bootstrap_room: Option<Value>,
}

/// A request's part in SGLang's disaggregated serving.
#[derive(Debug)]
pub(crate) enum PdLeg {
    /// Not disaggregated (`--disaggregation-mode null`).
    Off,
    /// A prefill leg, in its room.
    Prefill(PrefillSeat),
    /// A decode leg: the bootstrap server (`host:port`) and room its KV comes from.
    Decode {
        /// The prefill engine's bootstrap server.
        address: String,
        /// The room.
        room: u64,
    },
}

/// A 400 naming `param`.
fn invalid(param: &'static str, message: String) -> ApiError {
    ApiError::bad_request(message).with_param(param)
}

/// A 500 with `message`.
fn failed(message: String) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
}

impl PdLeg {
    /// The leg `body` (a request of `sequences` sequences, answered as `id`) is on this
    /// engine; refused as SGLang refuses it without `bootstrap_room`.
    pub(crate) fn of(
        state: &EngineState,
        body: &[u8],
        sequences: usize,
        id: &str,
    ) -> Result<Self, ApiError> {
        let sglang = &state.config.kv_transfer.sglang;
        if sglang.mode == DisaggregationMode::Null {
            return Ok(Self::Off);
        }
        let fields: BootstrapFields = parse_json(body)?;
        let room = match fields.bootstrap_room {
            None | Some(Value::Null) => {
                return Err(ApiError::bad_request(format!(
                    "Invalid request: Disaggregated request received without bootstrap room id. req.rid='{id}'"
                )));
            }
            Some(room) => room.as_u64().ok_or_else(|| {
                invalid(
                    "bootstrap_room",
                    format!("bootstrap_room must be one non-negative integer here, not {room}"),
                )
            })?,
        };
        if sequences != 1 {
            return Err(invalid(
                "bootstrap_room",
                "a disaggregated leg takes exactly one prompt and n: 1".to_owned(),
            ));
        }
        match sglang.mode {
            DisaggregationMode::Prefill => state
                .rooms
                .enter_prefill(room)
                .map(Self::Prefill)
                .ok_or_else(|| {
                    invalid(
                        "bootstrap_room",
                        format!("bootstrap_room {room} is taken by another prefill leg here"),
                    )
                }),
            _ => {
                let host = match fields.bootstrap_host {
                    Some(Value::String(host)) if !host.is_empty() => host,
                    _ => {
                        return Err(invalid(
                            "bootstrap_host",
                            "a decode leg needs bootstrap_host, the prefill engine's host"
                                .to_owned(),
                        ));
                    }
                };
                let port = match fields.bootstrap_port {
                    None | Some(Value::Null) => sglang.bootstrap_port,
                    Some(port) => port
                        .as_u64()
                        .and_then(|p| u16::try_from(p).ok())
                        .ok_or_else(|| {
                            invalid(
                                "bootstrap_port",
                                format!("bootstrap_port must be one port number, not {port}"),
                            )
                        })?,
                };
                let address = if host.contains(':') {
                    format!("[{host}]:{port}")
                } else {
                    format!("{host}:{port}")
                };
                Ok(Self::Decode { address, room })
            }
        }
    }

    /// `params` for this leg: a prefill leg generates one token.
    pub(crate) fn params(&self, mut params: GenParams) -> GenParams {
        if matches!(self, Self::Prefill(_)) {
            params.max_tokens = 1;
        }
        params
    }

    /// What the leg hands off, before it is submitted: a prefill leg waits for its decode
    /// engine and holds its KV for it; a decode leg receives the KV (on the engine core it is
    /// placed on now: `rank` becomes fixed) of `prompt` (served with `lora`, under
    /// `cache_salt`). `id` names the request in errors.
    pub(crate) async fn handoff(
        &self,
        state: &EngineState,
        rank: &mut RankChoice,
        prompt: Option<&[u32]>,
        lora: Option<&Lora>,
        cache_salt: Option<&str>,
        id: &str,
    ) -> Result<Handoff, ApiError> {
        let sglang = &state.config.kv_transfer.sglang;
        match self {
            Self::Off => Ok(Handoff::None),
            Self::Prefill(seat) => {
                let room = seat.id();
                let started = Instant::now();
                seat.joined(sglang.bootstrap_timeout).await.map_err(|why| {
                    let why = why.unwrap_or_else(|| {
                        format!(
                            "Request {room} timed out after {:.1}s in KVPoll.Bootstrapping",
                            started.elapsed().as_secs_f64()
                        )
                    });
                    failed(format!(
                        "Prefill bootstrap failed for request rank=0 req.rid='{id}' req.bootstrap_room={room} with exception KVTransferError(bootstrap_room={room}): {why}"
                    ))
                })?;
                Ok(Handoff::Hold(hold_id(room)))
            }
            Self::Decode { address, room } => {
                let core = match *rank {
                    RankChoice::Fixed(core) => core,
                    RankChoice::Balanced => state.balanced_rank(),
                };
                *rank = RankChoice::Fixed(core);
                let cached = match prompt {
                    Some(prompt) => cached_blocks(state, core, prompt, lora, cache_salt).await?,
                    None => 0,
                };
                let core = state.rank(core);
                let started = Instant::now();
                let received = receive(
                    &core.puller,
                    address,
                    *room,
                    cached,
                    sglang.waiting_timeout,
                    &core.metrics,
                )
                .await;
                match received {
                    Ok(RoomKv {
                        blocks,
                        cached_tokens,
                        ..
                    }) => Ok(Handoff::Transferred {
                        tokens: blocks * state.config.block_size,
                        cached: cached_tokens,
                    }),
                    Err(error) => {
                        let why = match error {
                            ReceiveError::TimedOut => format!(
                                "Request {room} timed out after {:.1}s in KVPoll.WaitingForInput",
                                started.elapsed().as_secs_f64()
                            ),
                            ReceiveError::Unreachable(error) => {
                                tracing::warn!(%address, %error, "bootstrap server unreachable");
                                format!(
                                    "Could not fetch prefill parallel info from bootstrap_addr: {address}"
                                )
                            }
                            ReceiveError::Failed(why) => why,
                        };
                        Err(failed(format!(
                            "Decode transfer failed for request rank=0 decode_req.req.rid='{id}' decode_req.req.bootstrap_room={room} with exception KVTransferError(bootstrap_room={room}): {why}"
                        )))
                    }
                }
            }
        }
    }

    /// The events of the leg's `sequences` sequences (`rx`), once they may go out: a prefill
    /// leg's once its decode engine has the KV (SGLang answers a prefill leg once the
    /// transfer succeeded), the others' at once.
    pub(crate) async fn deliver(
        self,
        state: &EngineState,
        mut rx: UnboundedReceiver<SeqEvent>,
        sequences: usize,
        id: &str,
    ) -> Result<UnboundedReceiver<SeqEvent>, ApiError> {
        let Self::Prefill(seat) = self else {
            return Ok(rx);
        };
        let mut events = Vec::new();
        let mut ended = 0;
        let mut kv = None;
        let mut broken = false;
        while ended < sequences {
            let Some(event) = rx.recv().await else {
                break;
            };
            match &event {
                SeqEvent::Finished(outcome) => {
                    ended += 1;
                    kv = Some(RoomKv {
                        blocks: outcome.held_blocks.len(),
                        prompt_tokens: outcome.prompt_tokens,
                        cached_tokens: outcome.cached_tokens,
                    });
                }
                SeqEvent::Failed { .. } => {
                    ended += 1;
                    broken = true;
                }
                SeqEvent::Delta { .. } => {}
            }
            events.push(event);
        }
        if let (Some(kv), false) = (kv, broken) {
            seat.prefilled(kv);
            let room = seat.id();
            let hold = state.config.kv_transfer.hold_timeout;
            seat.transferred(hold).await.map_err(|why| {
                failed(format!(
                    "Prefill transfer failed for request rank=0 req.rid='{id}' req.bootstrap_room={room} with exception KVTransferError(bootstrap_room={room}): {why}"
                ))
            })?;
        }
        let (tx, replay) = mpsc::unbounded_channel();
        for event in events {
            // The receiver is in hand: the send cannot fail.
            let _ = tx.send(event);
        }
        Ok(replay)
    }
}
