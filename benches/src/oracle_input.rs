//! Feeding the oracle a workload's prompts as the engines will see them: trace prompts by
//! expanding their hash ids, chat prompts through the model's chat template and tokenizer.

use std::path::Path;

use kvmesh_kv::HashError;
use kvmesh_preprocess::{ChatRequest, ModelPreprocessor, PreprocessError};

use crate::oracle::{Oracle, OracleReport, OracleSpec};
use crate::scheduled::ScheduledWorkload;
use crate::trace::TraceRecord;

/// Failure to compute the oracle.
#[derive(Debug, thiserror::Error)]
pub enum OracleInputError {
    /// The block size is unusable.
    #[error(transparent)]
    Hash(#[from] HashError),
    /// The tokenizer could not be loaded or a prompt not rendered.
    #[error("chat oracle: {0}")]
    Preprocess(#[from] PreprocessError),
}

/// The oracle over a trace's prompts, expanded with `trace_block_size` tokens per hash id.
pub fn trace_oracle(
    records: &[TraceRecord],
    trace_block_size: usize,
    spec: OracleSpec,
) -> Result<OracleReport, OracleInputError> {
    let mut oracle = Oracle::new(spec)?;
    let mut tokens = Vec::new();
    for record in records {
        record.expand_into(trace_block_size, &mut tokens);
        oracle.observe(&tokens);
    }
    Ok(oracle.report())
}

/// The oracle over a chat workload's prompts, rendered and tokenized with the model in
/// `tokenizer_dir` (`tokenizer.json`, `tokenizer_config.json`).
pub fn chat_oracle(
    workload: &ScheduledWorkload,
    tokenizer_dir: &Path,
    spec: OracleSpec,
) -> Result<OracleReport, OracleInputError> {
    let model = ModelPreprocessor::from_dir(tokenizer_dir)?;
    let mut oracle = Oracle::new(spec)?;
    for body in workload.bodies() {
        let request = ChatRequest::from_slice(body)?;
        oracle.observe(&model.chat_token_ids(&request)?);
    }
    Ok(oracle.report())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_prompts_hit_their_shared_hash_ids() {
        let record = |ids: Vec<u64>, len| TraceRecord {
            timestamp: 0,
            input_length: len,
            output_length: 1,
            hash_ids: ids,
        };
        let records = [record(vec![1, 2], 16), record(vec![1, 3], 13)];
        let spec = OracleSpec {
            block_size: 4,
            engines: 2,
            blocks_per_engine: 100,
        };
        let r = trace_oracle(&records, 8, spec).expect("oracle");
        assert_eq!(r.prompt_tokens, 29);
        // The second prompt shares hash id 1: 8 tokens, two blocks of 4.
        assert_eq!(r.hit_tokens, 8);
        assert_eq!(r.infinite_hit_tokens, 8);
    }

    #[test]
    fn a_missing_tokenizer_is_an_error() {
        let w = ScheduledWorkload::from_chat(
            &[],
            "m",
            1,
            false,
            &crate::target::Target {
                addr: "127.0.0.1:1".parse().expect("addr"),
                authority: http::uri::Authority::from_static("127.0.0.1:1"),
                base_path: String::new(),
            },
            false,
        )
        .expect("workload");
        let spec = OracleSpec {
            block_size: 4,
            engines: 1,
            blocks_per_engine: 1,
        };
        assert!(matches!(
            chat_oracle(&w, Path::new("/nonexistent"), spec),
            Err(OracleInputError::Preprocess(_))
        ));
    }
}
