//! Shared by the generation endpoints: model resolution, tokenization, validation, submission
//! and collection of results.

use std::time::Instant;

use http::StatusCode;
use tokio::sync::mpsc::{self, UnboundedReceiver};

use super::dp_rank::RankChoice;
use super::error::ApiError;
use super::state::EngineState;
use crate::chat_template::{self, ChatMessage};
use crate::hashing::{BlockHasher, XXH3_SEED, content_seed};
use crate::lora::Lora;
use crate::protocol::prompt::PromptInput;
use crate::protocol::requests::GenParams;
use crate::protocol::responses::Usage;
use crate::scheduler::{Handoff, SeqEvent, SeqOutcome, SeqRequest};

/// Parses a JSON request body (400 when it does not fit `T`).
pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

/// What a request's `model` names: a loaded LoRA adapter (`Some`, looked up first, as vLLM
/// does) or the served base model (`None`; also when `model` is absent). Anything else is
/// vLLM's 404.
pub(crate) fn resolve_model(
    state: &EngineState,
    model: Option<&str>,
) -> Result<Option<Lora>, ApiError> {
    let Some(m) = model else {
        return Ok(None);
    };
    if let Some(lora) = state.loras.resolve(m) {
        return Ok(Some(lora));
    }
    if m == state.config.model {
        return Ok(None);
    }
    Err(ApiError::new(
        StatusCode::NOT_FOUND,
        format!("The model `{m}` does not exist."),
    )
    .with_param("model"))
}

/// The `model` a response carries: the adapter's name when one served it (vLLM echoes it),
/// else the served model name.
pub(crate) fn model_name<'a>(state: &'a EngineState, lora: Option<&'a Lora>) -> &'a str {
    lora.map_or(state.config.model.as_str(), |l| &l.name)
}

/// Token ids of every prompt in `input`; text is tokenized (`add_special_tokens` for plain
/// completions), ids pass through untouched.
pub(crate) fn tokenize_prompts(
    state: &EngineState,
    input: PromptInput,
    add_special_tokens: bool,
    param: &'static str,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let encode = |text: &str| {
        state
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|m| ApiError::bad_request(m).with_param(param))
    };
    let prompts = match input {
        PromptInput::Text(t) => vec![encode(&t)?],
        PromptInput::Texts(ts) => ts.iter().map(|t| encode(t)).collect::<Result<_, _>>()?,
        PromptInput::Tokens(ids) => vec![ids],
        PromptInput::TokenLists(lists) => lists,
    };
    if prompts.is_empty() {
        return Err(
            ApiError::bad_request(format!("{param} must contain at least one prompt"))
                .with_param(param),
        );
    }
    Ok(prompts)
}

/// Token ids of `messages` rendered with the chat template (errors name field `param`).
pub(crate) fn tokenize_chat(
    state: &EngineState,
    messages: &[ChatMessage],
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    tokenize_chat_ending(
        state,
        messages,
        chat_template::Ending::GenerationPrompt,
        param,
    )
}

/// [`tokenize_chat`] with the conversation ending as `ending` says.
pub(crate) fn tokenize_chat_ending(
    state: &EngineState,
    messages: &[ChatMessage],
    ending: chat_template::Ending,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    let text = chat_template::render(messages, ending);
    state
        .tokenizer
        .encode(&text, false)
        .map_err(|m| ApiError::bad_request(m).with_param(param))
}

/// Checks every prompt against the context length and the cache size, as vLLM 0.32 does: a
/// prompt that leaves no room for one generated token is refused (`param: input_tokens`); a
/// longer `max_tokens` is not, its sequence stops at the context length instead
/// ([`max_tokens_within`]).
pub(crate) fn validate_lengths(
    state: &EngineState,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> Result<(), ApiError> {
    let cfg = &state.config;
    for prompt in prompts {
        if prompt.is_empty() {
            return Err(ApiError::bad_request("The prompt cannot be empty.").with_param("prompt"));
        }
        if prompt.len() >= cfg.max_model_len {
            return Err(ApiError::bad_request(format!(
                "This model's maximum context length is {} tokens. However, your prompt contains {} input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt.",
                cfg.max_model_len,
                prompt.len(),
            ))
            .with_param("input_tokens"));
        }
        let total = prompt.len() + max_tokens_within(cfg.max_model_len, prompt.len(), max_tokens);
        // The last generated token never needs KV, hence `total - 1`.
        let blocks = cfg.blocks_for(total - 1);
        if blocks > cfg.num_gpu_blocks {
            return Err(ApiError::bad_request(format!(
                "The request needs {blocks} KV blocks of {} tokens but the engine only has {}.",
                cfg.block_size, cfg.num_gpu_blocks
            )));
        }
    }
    Ok(())
}

/// The tokens a sequence may generate: `max_tokens`, cut where prompt and completion reach
/// the context length `max_model_len` (vLLM 0.32 finishes such a request with `length`).
pub(crate) fn max_tokens_within(max_model_len: usize, prompt: usize, max_tokens: usize) -> usize {
    max_tokens.min(max_model_len.saturating_sub(prompt))
}

/// Spreads the word seeds of a prompt's choices (an odd constant, the golden ratio's).
const CHOICE_SEED_STEP: u64 = 0x9E37_79B9_7F4A_7C15;

/// Queues `params.n` sequences per prompt (choice `p * n + i` is prompt `p`'s `i`-th;
/// prompts checked by [`validate_lengths`]), served with adapter `lora` (`None`: the base
/// model), each with `handoff` (disaggregated legs have one prompt), on the engine core
/// `rank` names; returns the receiver of their events.
pub(crate) fn submit(
    state: &EngineState,
    prompts: Vec<Vec<u32>>,
    params: &GenParams,
    lora: Option<&Lora>,
    arrival: Instant,
    handoff: Handoff,
    rank: RankChoice,
) -> Result<UnboundedReceiver<SeqEvent>, ApiError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut hasher = BlockHasher::new();
    let hash_seed = lora.map_or(XXH3_SEED, Lora::hash_seed);
    let mut seqs = Vec::with_capacity(prompts.len() * params.n);
    for mut prompt in prompts {
        // Hashed and seeded once for all its choices; the last choice takes the prompt.
        let mut prompt_hashes = if state.config.enable_prefix_caching {
            hasher.salted_sequence_hashes(
                &prompt,
                state.config.block_size,
                hash_seed,
                params.cache_salt.as_deref(),
            )
        } else {
            Vec::new()
        };
        let seed = content_seed(&prompt);
        let max_tokens =
            max_tokens_within(state.config.max_model_len, prompt.len(), params.max_tokens);
        for choice in 0..params.n {
            let last = choice + 1 == params.n;
            seqs.push(SeqRequest {
                // Prompt and choice counts are bounded by the body size and `n`'s limit.
                index: seqs.len() as u32,
                // Choice 0 writes what `n: 1` would; the others their own words.
                seed: seed ^ (choice as u64).wrapping_mul(CHOICE_SEED_STEP),
                prompt: if last {
                    std::mem::take(&mut prompt)
                } else {
                    prompt.clone()
                },
                prompt_hashes: if last {
                    std::mem::take(&mut prompt_hashes)
                } else {
                    prompt_hashes.clone()
                },
                lora: lora.cloned(),
                cache_salt: params.cache_salt.clone(),
                max_tokens,
                stops: params.stops.clone(),
                stream: params.stream,
                arrival,
                tx: tx.clone(),
                handoff: handoff.clone(),
            });
        }
    }
    state
        .submit(seqs, rank)
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
    Ok(rx)
}

/// Leading full blocks of `prompt` (for `lora`, under `cache_salt`) the prefix cache of
/// engine core `rank` holds, capped as vLLM caps a hit (the last prompt token is always
/// computed): what a decode leg need not pull.
pub(crate) async fn cached_blocks(
    state: &EngineState,
    rank: usize,
    prompt: &[u32],
    lora: Option<&Lora>,
    cache_salt: Option<&str>,
) -> Result<usize, ApiError> {
    if !state.config.enable_prefix_caching {
        return Ok(0);
    }
    let block_size = state.config.block_size;
    let mut hashes = BlockHasher::new().salted_sequence_hashes(
        prompt,
        block_size,
        lora.map_or(XXH3_SEED, Lora::hash_seed),
        cache_salt,
    );
    hashes.truncate(prompt.len().saturating_sub(1) / block_size);
    state
        .rank(rank)
        .scheduler
        .cached_prefix(hashes)
        .await
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))
}

/// Adds a finished sequence to `usage`: its prompt once per prompt (on its first of `n`
/// choices), as vLLM counts a prompt shared by several choices.
pub(crate) fn add_usage(usage: &mut Usage, outcome: &SeqOutcome, n: usize) {
    let (prompt, cached) = if (outcome.index as usize).is_multiple_of(n) {
        (outcome.prompt_tokens, outcome.cached_tokens)
    } else {
        (0, 0)
    };
    usage.add(prompt, cached, outcome.completion_tokens);
}

/// Waits for `count` sequences to finish; outcomes ordered by index.
pub(crate) async fn collect(
    mut rx: UnboundedReceiver<SeqEvent>,
    count: usize,
) -> Result<Vec<SeqOutcome>, ApiError> {
    let mut outcomes = Vec::with_capacity(count);
    while outcomes.len() < count {
        match rx.recv().await {
            Some(SeqEvent::Finished(o)) => outcomes.push(o),
            Some(SeqEvent::Delta { .. }) => {}
            Some(SeqEvent::Failed { message, .. }) => return Err(ApiError::bad_request(message)),
            None => {
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the engine is shutting down",
                ));
            }
        }
    }
    outcomes.sort_by_key(|o| o.index);
    Ok(outcomes)
}

#[cfg(test)]
mod tests {
    use super::max_tokens_within;

    #[test]
    fn max_tokens_stop_at_the_context_length_as_in_vllm() {
        // vLLM 0.32, max_model_len 4096: a 4000-token prompt with max_tokens 200 generates 96.
        assert_eq!(max_tokens_within(4096, 4000, 200), 96);
        assert_eq!(max_tokens_within(4096, 100, 200), 200);
        assert_eq!(max_tokens_within(4096, 4095, 16), 1);
    }
}
