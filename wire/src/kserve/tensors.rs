//! Decoding a request's input tensors, from typed `contents` or from
//! `raw_input_contents` (little-endian; a BYTES element is a 4-byte little-endian length
//! and its bytes).

use kvmesh_proto::inference::ModelInferRequest;
use kvmesh_proto::inference::model_infer_request::InferInputTensor;

use crate::kserve::invalid::InvalidInput;

/// Input: the prompt as text.
pub const TEXT_INPUT: &str = "text_input";
/// Input: the prompt as token ids.
pub const INPUT_IDS: &str = "input_ids";
/// Input: stream the answer (one response per generated chunk).
pub const STREAMING: &str = "streaming";
/// Input: another name of [`STREAMING`] (Triton's vLLM backend calls it so).
pub const STREAM: &str = "stream";
/// Input: sampling parameters as a JSON object (Triton's vLLM backend convention).
pub const SAMPLING_PARAMETERS: &str = "sampling_parameters";

/// The prompt as the request gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// `text_input`.
    Text(String),
    /// `input_ids`.
    Tokens(Vec<u32>),
}

/// The decoded inputs of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inputs {
    /// The prompt.
    pub prompt: PromptInput,
    /// `streaming` (or `stream`): answer with one response per generated chunk.
    pub streaming: bool,
    /// `sampling_parameters`: a JSON object of sampling parameters.
    pub sampling_parameters: Option<String>,
}

/// Where one input's data is.
#[derive(Clone, Copy)]
enum Data<'a> {
    /// `inputs[i].contents`.
    Typed(&'a InferInputTensor),
    /// `raw_input_contents[i]`.
    Raw(&'a [u8]),
}

/// Decodes and checks the inputs of `request`.
pub fn read_inputs(request: &ModelInferRequest) -> Result<Inputs, InvalidInput> {
    let raw = &request.raw_input_contents;
    if !raw.is_empty() {
        if raw.len() != request.inputs.len() {
            return Err(InvalidInput::new(format!(
                "raw_input_contents has {} entries for {} inputs; give one per input",
                raw.len(),
                request.inputs.len()
            )));
        }
        if let Some(input) = request.inputs.iter().find(|i| i.contents.is_some()) {
            return Err(InvalidInput::new(format!(
                "input {:?} has contents while the request uses raw_input_contents; use one form",
                input.name
            )));
        }
    }
    let mut text = None;
    let mut tokens = None;
    let mut streaming = None;
    let mut sampling = None;
    for (i, input) in request.inputs.iter().enumerate() {
        let data = match raw.get(i) {
            Some(bytes) => Data::Raw(bytes),
            None => Data::Typed(input),
        };
        let name = input.name.as_str();
        let slot_taken = match name {
            TEXT_INPUT => text.replace(single_string(input, data)?).is_some(),
            INPUT_IDS => tokens.replace(token_ids(input, data)?).is_some(),
            STREAMING | STREAM => streaming.replace(single_bool(input, data)?).is_some(),
            SAMPLING_PARAMETERS => sampling.replace(single_string(input, data)?).is_some(),
            _ => {
                return Err(InvalidInput::new(format!(
                    "unknown input {name:?}; supported inputs: {TEXT_INPUT}, {INPUT_IDS}, \
                     {STREAMING} (or {STREAM}), {SAMPLING_PARAMETERS}"
                )));
            }
        };
        if slot_taken {
            return Err(InvalidInput::new(format!("input {name:?} is given twice")));
        }
    }
    let prompt = match (text, tokens) {
        (Some(text), None) => PromptInput::Text(text),
        (None, Some(ids)) => PromptInput::Tokens(ids),
        (Some(_), Some(_)) => {
            return Err(InvalidInput::new(format!(
                "give either {TEXT_INPUT} or {INPUT_IDS}, not both"
            )));
        }
        (None, None) => {
            return Err(InvalidInput::new(format!(
                "the prompt is missing: give the input {TEXT_INPUT} (BYTES) or {INPUT_IDS} (INT32/INT64)"
            )));
        }
    };
    Ok(Inputs {
        prompt,
        streaming: streaming.unwrap_or(false),
        sampling_parameters: sampling,
    })
}

/// Number of elements `input`'s shape holds (an empty shape is a scalar).
fn element_count(input: &InferInputTensor) -> Result<usize, InvalidInput> {
    input.shape.iter().try_fold(1usize, |count, &dim| {
        usize::try_from(dim)
            .ok()
            .and_then(|dim| count.checked_mul(dim))
            .ok_or_else(|| {
                InvalidInput::new(format!(
                    "input {:?} has an invalid shape {:?}",
                    input.name, input.shape
                ))
            })
    })
}

fn expect_datatype(input: &InferInputTensor, allowed: &[&str]) -> Result<(), InvalidInput> {
    if allowed.contains(&input.datatype.as_str()) {
        return Ok(());
    }
    Err(InvalidInput::new(format!(
        "input {:?} has datatype {:?}; expected {}",
        input.name,
        input.datatype,
        allowed.join(" or ")
    )))
}

fn expect_one(input: &InferInputTensor) -> Result<(), InvalidInput> {
    let count = element_count(input)?;
    if count != 1 {
        return Err(InvalidInput::new(format!(
            "input {:?} must hold exactly one element (shape [1]); its shape {:?} holds {count}",
            input.name, input.shape
        )));
    }
    Ok(())
}

fn count_mismatch(input: &InferInputTensor, expected: usize, found: usize) -> InvalidInput {
    InvalidInput::new(format!(
        "input {:?}: its shape {:?} holds {expected} elements but its data holds {found}",
        input.name, input.shape
    ))
}

/// The one UTF-8 string of a BYTES input.
fn single_string(input: &InferInputTensor, data: Data<'_>) -> Result<String, InvalidInput> {
    expect_datatype(input, &["BYTES"])?;
    expect_one(input)?;
    let bytes = match data {
        Data::Typed(input) => {
            let elements = input
                .contents
                .as_ref()
                .map_or(&[][..], |c| &c.bytes_contents[..]);
            match elements {
                [one] => one.clone(),
                _ => return Err(count_mismatch(input, 1, elements.len())),
            }
        }
        Data::Raw(raw) => {
            let elements = raw_bytes_elements(input, raw)?;
            match elements[..] {
                [one] => one.to_vec(),
                _ => return Err(count_mismatch(input, 1, elements.len())),
            }
        }
    };
    String::from_utf8(bytes)
        .map_err(|_| InvalidInput::new(format!("input {:?} is not valid UTF-8", input.name)))
}

/// Raw BYTES elements: each a 4-byte little-endian length, then that many bytes.
fn raw_bytes_elements<'a>(
    input: &InferInputTensor,
    mut raw: &'a [u8],
) -> Result<Vec<&'a [u8]>, InvalidInput> {
    let mut elements = Vec::with_capacity(1);
    while !raw.is_empty() {
        let malformed = || {
            InvalidInput::new(format!(
                "raw contents of input {:?} are not length-prefixed BYTES elements",
                input.name
            ))
        };
        let (length, rest) = raw.split_first_chunk::<4>().ok_or_else(malformed)?;
        let length = usize::try_from(u32::from_le_bytes(*length)).map_err(|_| malformed())?;
        if rest.len() < length {
            return Err(malformed());
        }
        let (element, rest) = rest.split_at(length);
        elements.push(element);
        raw = rest;
    }
    Ok(elements)
}

/// The one boolean of a BOOL input.
fn single_bool(input: &InferInputTensor, data: Data<'_>) -> Result<bool, InvalidInput> {
    expect_datatype(input, &["BOOL"])?;
    expect_one(input)?;
    let values: Vec<bool> = match data {
        Data::Typed(input) => input
            .contents
            .as_ref()
            .map_or_else(Vec::new, |c| c.bool_contents.clone()),
        Data::Raw(raw) => raw.iter().map(|&b| b != 0).collect(),
    };
    match values[..] {
        [one] => Ok(one),
        _ => Err(count_mismatch(input, 1, values.len())),
    }
}

/// The token ids of an integer input of shape `[n]` or `[1, n]`.
fn token_ids(input: &InferInputTensor, data: Data<'_>) -> Result<Vec<u32>, InvalidInput> {
    expect_datatype(input, &["INT32", "INT64", "UINT32", "UINT64"])?;
    let count = element_count(input)?;
    let batch_of_one = match input.shape[..] {
        [_] => true,
        [batch, _] => batch == 1,
        _ => false,
    };
    if !batch_of_one || count == 0 {
        return Err(InvalidInput::new(format!(
            "input {INPUT_IDS:?} must have shape [n] or [1, n] with n > 0; got {:?}",
            input.shape
        )));
    }
    let values: Vec<i128> = match data {
        Data::Typed(input) => {
            let contents = input.contents.clone().unwrap_or_default();
            match input.datatype.as_str() {
                "INT32" => contents.int_contents.into_iter().map(i128::from).collect(),
                "INT64" => contents
                    .int64_contents
                    .into_iter()
                    .map(i128::from)
                    .collect(),
                "UINT32" => contents.uint_contents.into_iter().map(i128::from).collect(),
                _ => contents
                    .uint64_contents
                    .into_iter()
                    .map(i128::from)
                    .collect(),
            }
        }
        Data::Raw(raw) => raw_integers(input, raw)?,
    };
    if values.len() != count {
        return Err(count_mismatch(input, count, values.len()));
    }
    values
        .into_iter()
        .map(|id| {
            u32::try_from(id).map_err(|_| {
                InvalidInput::new(format!("input {INPUT_IDS:?} holds {id}, not a token id"))
            })
        })
        .collect()
}

/// Little-endian integers of `input`'s datatype.
fn raw_integers(input: &InferInputTensor, raw: &[u8]) -> Result<Vec<i128>, InvalidInput> {
    let width = match input.datatype.as_str() {
        "INT32" | "UINT32" => 4,
        _ => 8,
    };
    if !raw.len().is_multiple_of(width) {
        return Err(InvalidInput::new(format!(
            "raw contents of input {:?} are {} bytes, not a whole number of {} values",
            input.name,
            raw.len(),
            input.datatype
        )));
    }
    Ok(raw
        .chunks_exact(width)
        .map(|chunk| {
            let mut bytes = [0u8; 8];
            bytes[..width].copy_from_slice(chunk);
            match input.datatype.as_str() {
                "INT32" => i128::from(i32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])),
                "UINT32" => {
                    i128::from(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
                }
                "INT64" => i128::from(i64::from_le_bytes(bytes)),
                _ => i128::from(u64::from_le_bytes(bytes)),
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_proto::inference::InferTensorContents;

    fn tensor(
        name: &str,
        datatype: &str,
        shape: &[i64],
        contents: Option<InferTensorContents>,
    ) -> InferInputTensor {
        InferInputTensor {
            name: name.to_string(),
            datatype: datatype.to_string(),
            shape: shape.to_vec(),
            parameters: Default::default(),
            contents,
        }
    }

    fn text(value: &str) -> InferInputTensor {
        tensor(
            TEXT_INPUT,
            "BYTES",
            &[1],
            Some(InferTensorContents {
                bytes_contents: vec![value.as_bytes().to_vec()],
                ..Default::default()
            }),
        )
    }

    fn request(inputs: Vec<InferInputTensor>, raw: Vec<Vec<u8>>) -> ModelInferRequest {
        ModelInferRequest {
            inputs,
            raw_input_contents: raw,
            ..Default::default()
        }
    }

    fn raw_bytes(elements: &[&str]) -> Vec<u8> {
        let mut out = Vec::new();
        for element in elements {
            out.extend_from_slice(&(element.len() as u32).to_le_bytes());
            out.extend_from_slice(element.as_bytes());
        }
        out
    }

    fn error(request: &ModelInferRequest) -> String {
        read_inputs(request).unwrap_err().0
    }

    #[test]
    fn text_from_contents_and_streaming_default_off() {
        let inputs = read_inputs(&request(vec![text("héllo")], vec![])).unwrap();
        assert_eq!(inputs.prompt, PromptInput::Text("héllo".into()));
        assert!(!inputs.streaming);
        assert_eq!(inputs.sampling_parameters, None);
    }

    #[test]
    fn everything_from_raw_contents() {
        let inputs = vec![
            tensor(TEXT_INPUT, "BYTES", &[1, 1], None),
            tensor(STREAM, "BOOL", &[1], None),
            tensor(SAMPLING_PARAMETERS, "BYTES", &[1], None),
        ];
        let raw = vec![raw_bytes(&["hi"]), vec![1], raw_bytes(&["{\"seed\":1}"])];
        let read = read_inputs(&request(inputs, raw)).unwrap();
        assert_eq!(read.prompt, PromptInput::Text("hi".into()));
        assert!(read.streaming);
        assert_eq!(read.sampling_parameters.as_deref(), Some("{\"seed\":1}"));
    }

    #[test]
    fn token_ids_in_every_integer_form() {
        let typed32 = tensor(
            INPUT_IDS,
            "INT32",
            &[1, 3],
            Some(InferTensorContents {
                int_contents: vec![5, 6, 7],
                ..Default::default()
            }),
        );
        let read = read_inputs(&request(vec![typed32], vec![])).unwrap();
        assert_eq!(read.prompt, PromptInput::Tokens(vec![5, 6, 7]));
        let typed64 = tensor(
            INPUT_IDS,
            "INT64",
            &[2],
            Some(InferTensorContents {
                int64_contents: vec![1, 2],
                ..Default::default()
            }),
        );
        assert_eq!(
            read_inputs(&request(vec![typed64], vec![])).unwrap().prompt,
            PromptInput::Tokens(vec![1, 2])
        );
        let raw: Vec<u8> = [9i64, 10].iter().flat_map(|v| v.to_le_bytes()).collect();
        let read = read_inputs(&request(
            vec![tensor(INPUT_IDS, "INT64", &[2], None)],
            vec![raw],
        ))
        .unwrap();
        assert_eq!(read.prompt, PromptInput::Tokens(vec![9, 10]));
        let raw: Vec<u8> = [3i32].iter().flat_map(|v| v.to_le_bytes()).collect();
        let read = read_inputs(&request(
            vec![tensor(INPUT_IDS, "INT32", &[1], None)],
            vec![raw],
        ))
        .unwrap();
        assert_eq!(read.prompt, PromptInput::Tokens(vec![3]));
    }

    #[test]
    fn malformed_tensors_name_the_problem() {
        let cases: Vec<(ModelInferRequest, &str)> = vec![
            (request(vec![], vec![]), "the prompt is missing"),
            (request(vec![text("a"), text("b")], vec![]), "given twice"),
            (
                request(vec![tensor("image", "FP32", &[1], None)], vec![]),
                "unknown input \"image\"",
            ),
            (
                request(vec![tensor(TEXT_INPUT, "INT32", &[1], None)], vec![]),
                "expected BYTES",
            ),
            (
                request(vec![tensor(TEXT_INPUT, "BYTES", &[2], None)], vec![]),
                "exactly one element",
            ),
            (
                request(vec![tensor(TEXT_INPUT, "BYTES", &[1], None)], vec![]),
                "holds 1 elements but its data holds 0",
            ),
            (
                request(vec![tensor(TEXT_INPUT, "BYTES", &[-1], None)], vec![]),
                "invalid shape",
            ),
            (
                request(
                    vec![tensor(TEXT_INPUT, "BYTES", &[1], None)],
                    vec![vec![9, 0, 0, 0, b'x']],
                ),
                "not length-prefixed",
            ),
            (
                request(
                    vec![tensor(TEXT_INPUT, "BYTES", &[1], None)],
                    vec![raw_bytes(&["\u{0}"]), vec![]],
                ),
                "2 entries for 1 inputs",
            ),
            (
                request(
                    vec![text("a"), tensor(STREAMING, "BOOL", &[1], None)],
                    vec![vec![], vec![]],
                ),
                "use one form",
            ),
            (
                request(
                    vec![tensor(TEXT_INPUT, "BYTES", &[1], None)],
                    vec![vec![2, 0, 0, 0, 0xff, 0xfe]],
                ),
                "not valid UTF-8",
            ),
            (
                request(
                    vec![tensor(
                        INPUT_IDS,
                        "INT64",
                        &[2, 2],
                        Some(InferTensorContents {
                            int64_contents: vec![1, 2, 3, 4],
                            ..Default::default()
                        }),
                    )],
                    vec![],
                ),
                "shape [n] or [1, n]",
            ),
            (
                request(
                    vec![tensor(
                        INPUT_IDS,
                        "INT64",
                        &[1],
                        Some(InferTensorContents {
                            int64_contents: vec![-1],
                            ..Default::default()
                        }),
                    )],
                    vec![],
                ),
                "holds -1, not a token id",
            ),
            (
                request(
                    vec![tensor(INPUT_IDS, "INT32", &[2], None)],
                    vec![vec![1, 0, 0]],
                ),
                "not a whole number",
            ),
            (
                request(
                    vec![
                        text("a"),
                        tensor(
                            INPUT_IDS,
                            "INT64",
                            &[1],
                            Some(InferTensorContents {
                                int64_contents: vec![1],
                                ..Default::default()
                            }),
                        ),
                    ],
                    vec![],
                ),
                "not both",
            ),
        ];
        for (request, expected) in cases {
            let message = error(&request);
            assert!(message.contains(expected), "{message:?} lacks {expected:?}");
        }
    }
}
