//! One prompt's life inside the scheduler.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use super::{Handoff, SeqEvent, SeqRequest};
use crate::hashing::{EngineHash, XXH3_SEED};
use crate::kv_cache::BlockId;
use crate::lora::Lora;
use crate::output_text::OutputText;
use crate::textgen::WordGenerator;

/// A sequence's tokens, KV blocks and output state.
#[derive(Debug)]
pub(crate) struct Sequence {
    /// Choice index within its HTTP request.
    pub index: u32,
    /// Prompt followed by the generated tokens.
    pub tokens: Vec<u32>,
    /// Length of the prompt part of `tokens`.
    pub prompt_len: usize,
    /// Sequence hashes of the full blocks of `tokens` known so far.
    pub hashes: Vec<u64>,
    /// The LoRA adapter it runs with (`None`: the base model); its blocks live in its hash space.
    pub lora: Option<Lora>,
    /// Seed of its local block hashes (see [`crate::hashing::lora_seed`]).
    pub hash_seed: u64,
    /// The request's `cache_salt`, which salts its first block's hashes.
    pub cache_salt: Option<Arc<str>>,
    /// Engine hashes of the leading blocks handled so far (parents of the next store).
    pub engine_hashes: Vec<EngineHash>,
    /// Block table.
    pub blocks: Vec<BlockId>,
    /// Tokens whose KV is computed.
    pub computed: usize,
    /// Tokens scheduled in the current iteration.
    pub scheduled: usize,
    /// The last iteration sampled a token for this sequence (it now decodes one token a step).
    pub decoding: bool,
    /// Generated tokens so far.
    pub generated: usize,
    /// Generation limit.
    pub max_tokens: usize,
    /// Prompt tokens found in the prefix cache at first admission (SGLang's decode leg: the
    /// prefill engine's, set at creation).
    pub cached_tokens: Option<usize>,
    /// Cache epoch at admission (no stores once the cache was reset).
    pub epoch: u64,
    /// Stream every token, or send only the final result.
    pub stream: bool,
    /// Generated text and stop rule.
    pub text: OutputText,
    /// Word source.
    pub words: WordGenerator,
    /// Arrival time at the engine.
    pub arrival: Instant,
    /// Time of the latest token.
    pub last_token: Option<Instant>,
    /// Where events for this sequence go.
    pub tx: UnboundedSender<SeqEvent>,
    /// Set when the sequence finished or was aborted; it is removed after the iteration.
    pub done: bool,
    /// A prefill leg: the request id its blocks are held under once it ends.
    pub hold: Option<String>,
    /// A decode leg: leading prompt tokens whose KV was pulled from a prefill engine (0 once
    /// admitted, or when preempted: the pulled KV is gone then and is recomputed).
    pub pulled_tokens: usize,
}

impl Sequence {
    /// A waiting sequence for `req`.
    pub(crate) fn new(req: SeqRequest) -> Self {
        let prompt_len = req.prompt.len();
        Self {
            index: req.index,
            tokens: req.prompt,
            prompt_len,
            hashes: req.prompt_hashes,
            hash_seed: req.lora.as_ref().map_or(XXH3_SEED, Lora::hash_seed),
            lora: req.lora,
            cache_salt: req.cache_salt,
            engine_hashes: Vec::new(),
            blocks: Vec::new(),
            computed: 0,
            scheduled: 0,
            decoding: false,
            generated: 0,
            max_tokens: req.max_tokens,
            cached_tokens: match req.handoff {
                Handoff::Transferred { cached, .. } => Some(cached),
                _ => None,
            },
            epoch: 0,
            stream: req.stream,
            text: OutputText::new(req.stops),
            words: WordGenerator::new(req.seed),
            arrival: req.arrival,
            last_token: None,
            tx: req.tx,
            done: false,
            hold: match &req.handoff {
                Handoff::Hold(id) => Some(id.clone()),
                _ => None,
            },
            pulled_tokens: match req.handoff {
                Handoff::Pulled(tokens) | Handoff::Transferred { tokens, .. } => tokens,
                _ => 0,
            },
        }
    }

    /// Tokens still missing from the KV cache (1 while decoding).
    pub(crate) fn missing(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// The adapter's name, for engine hashes; `None` for the base model.
    pub(crate) fn lora_name(&self) -> Option<&str> {
        self.lora.as_ref().map(|l| &*l.name)
    }

    /// Whether the client went away.
    pub(crate) fn cancelled(&self) -> bool {
        self.tx.is_closed()
    }
}
