//! Differential test of the request parser: every request kvmesh-h1 accepts is read the same
//! way by hyper's HTTP/1.1 server (`hyper::server::conn::http1`, over an in-memory duplex):
//! the same method, target (path and query as forwarded, and the authority of an absolute-form
//! target), header fields and body, and the request after it starts where kvmesh-h1 says it
//! does. Two readers that disagree on any of these are how a request meant for one server
//! reaches another (request smuggling), or how an engine behind the proxy reads another request
//! than the proxy routed.
//!
//! Requests are generated (proptest) from what HTTP/1.1 allows and what two parsers are most
//! likely to read differently: methods of any token characters; targets in origin form (mostly
//! RFC 3986 characters, sometimes ones it wants escaped, `#` among them), absolute form with
//! its `Host`, and `*`; field values with blanks and obs-text; bare-LF line ends in the head;
//! HTTP/1.0 and 1.1; bodies framed by `Content-Length` (repeated, as a list, with leading zeros
//! and blanks) or chunked (any case, sizes with leading zeros and upper-case digits, extensions
//! with quoted values and blanks, trailers). A request kvmesh-h1 refuses is skipped; at least
//! 80 % of them must be compared, so that the test is not vacuous.
//!
//! Differences exempt (docs/fuzzing.md):
//! - limits: kvmesh-h1 reads up to 256 fields, hyper 100 by default; hyper buffers at most
//!   about 400 KB of head and 16 KB of chunk extensions and of trailers, kvmesh-h1 4 KB per
//!   chunk-size or trailer line and 16 KB of trailers. Requests stay well below all of them.
//! - what hyper refuses (400) and kvmesh-h1 reads one way, so that no request is read two ways:
//!   `<`, `>` and `` ` `` in a path, `"`, `<` and `>` in a query (RFC 3986 wants them escaped;
//!   kvmesh-h1 passes them through, as httparse does), and a `Content-Length` written as a list
//!   of equal lengths (`5, 5`: RFC 9110 §8.6 lets a recipient refuse it or read one length).
//! - connection management, not parsing: after an HTTP/1.0 request without `keep-alive`, hyper
//!   closes the connection, so only the first request is compared.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Empty};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use kvmesh_h1::body::Decoded;
use kvmesh_h1::head::{AbsoluteForm, Parsed, parse_request};
use kvmesh_h1::strict::request_framing;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

/// The request that follows each generated one on the connection.
const NEXT: &[u8] = b"GET /next HTTP/1.1\r\nHost: a\r\n\r\n";

/// Longest a connection's requests take hyper to read (they are in memory).
const DEADLINE: Duration = Duration::from_secs(10);

/// A request as a reader understood it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    method: String,
    /// Path and query (`*` for the asterisk form), as forwarded to engines.
    target: String,
    /// The authority of an absolute-form target.
    authority: Option<String>,
    /// The header fields but the framing ones, names in lower case, sorted (hyper keeps the
    /// order per name only). `Content-Length` and `Transfer-Encoding` are compared by the body
    /// they frame: hyper folds repeated equal lengths into one field.
    fields: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
}

/// The fields but `Content-Length` and `Transfer-Encoding`, sorted.
fn sorted_fields(fields: impl Iterator<Item = (String, Vec<u8>)>) -> Vec<(String, Vec<u8>)> {
    let mut fields: Vec<_> = fields
        .filter(|(name, _)| name != "content-length" && name != "transfer-encoding")
        .collect();
    fields.sort();
    fields
}

/// The requests kvmesh-h1 reads from `raw`, as the proxy reads them (head, framing, body),
/// until one is refused or incomplete.
fn read_with_h1(raw: &[u8]) -> Vec<Seen> {
    let mut buf = BytesMut::from(raw);
    let mut seen = Vec::new();
    loop {
        let Parsed::Complete(head) = parse_request(&mut buf) else {
            return seen;
        };
        let Ok(mut framing) = request_framing(&head) else {
            return seen;
        };
        let mut body = Vec::new();
        loop {
            match framing.decode(&mut buf, false) {
                Ok(Decoded::Data(data)) => body.extend_from_slice(&data),
                Ok(Decoded::End) => break,
                Ok(Decoded::NeedMore) | Err(_) => return seen,
            }
        }
        let fields = sorted_fields(head.fields.iter().map(|(name, value)| {
            (
                String::from_utf8_lossy(name).to_ascii_lowercase(),
                value.to_vec(),
            )
        }));
        let authority = AbsoluteForm::split(head.target())
            .map(|absolute| String::from_utf8_lossy(absolute.authority).into_owned());
        seen.push(Seen {
            method: String::from_utf8_lossy(head.method()).into_owned(),
            target: String::from_utf8_lossy(head.origin_form()).into_owned(),
            authority,
            fields,
            body,
        });
    }
}

/// The requests hyper's server reads from `raw` on one connection, and whether the connection
/// ended in an error (a request hyper refused).
async fn read_with_hyper(raw: &[u8]) -> (Vec<Seen>, Option<String>) {
    let (mut client, server) = tokio::io::duplex(1 << 20);
    let (sender, mut received) = mpsc::unbounded_channel();
    let service =
        service_fn(move |request: Request<hyper::body::Incoming>| {
            let sender = sender.clone();
            async move {
                let (parts, body) = request.into_parts();
                let body = body.collect().await?.to_bytes();
                let fields =
                    sorted_fields(parts.headers.iter().map(|(name, value)| {
                        (name.as_str().to_owned(), value.as_bytes().to_vec())
                    }));
                let _ = sender.send(Seen {
                    method: parts.method.as_str().to_owned(),
                    target: parts
                        .uri
                        .path_and_query()
                        .map_or("/", |path| path.as_str())
                        .to_owned(),
                    authority: parts.uri.authority().map(|authority| authority.to_string()),
                    fields,
                    body: body.to_vec(),
                });
                Ok::<_, hyper::Error>(Response::new(Empty::<Bytes>::new()))
            }
        });
    let connection = http1::Builder::new()
        .half_close(true)
        .serve_connection(TokioIo::new(server), service);
    let io = async {
        client.write_all(raw).await?;
        client.shutdown().await?;
        let mut answers = Vec::new();
        client.read_to_end(&mut answers).await
    };
    let (served, _) = tokio::time::timeout(DEADLINE, async { tokio::join!(connection, io) })
        .await
        .expect("hyper reads the requests in time");
    let mut seen = Vec::new();
    while let Ok(request) = received.try_recv() {
        seen.push(request);
    }
    (seen, served.err().map(|error| error.to_string()))
}

/// Whether hyper (the `http` crate's URI) refuses `target` for a character RFC 3986 wants
/// escaped that kvmesh-h1, like httparse, passes through: `<`, `>` and `` ` `` in the path,
/// `"`, `<` and `>` in the query.
fn hyper_refuses_target(target: &[u8]) -> bool {
    let (path, query) = match target.iter().position(|&byte| byte == b'?') {
        Some(at) => target.split_at(at),
        None => (target, &b""[..]),
    };
    path.iter().any(|byte| b"<>`".contains(byte)) || query.iter().any(|byte| b"\"<>".contains(byte))
}

/// Whether hyper's refusal of `request` (its error `error`) is one of the exempt differences:
/// a target character ([`hyper_refuses_target`]), or a `Content-Length` written as a list of
/// equal lengths, which kvmesh-h1 reads as one (RFC 9110 §8.6 lets a recipient do either).
fn exempt(request: &Generated, error: &str) -> bool {
    match error {
        "invalid URI" => hyper_refuses_target(&request.target),
        "invalid content-length parsed" => request.length_list,
        _ => false,
    }
}

/// How one case went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// kvmesh-h1 refused the request: nothing to compare.
    Refused,
    /// hyper refused it for one of the exempt differences ([`exempt`]).
    Exempt,
    /// Both read the same requests.
    Same,
}

/// One case: whether kvmesh-h1 accepted the request, and if so whether hyper reads the same.
fn compare(
    runtime: &tokio::runtime::Runtime,
    request: &Generated,
) -> Result<Outcome, TestCaseError> {
    let mut raw = request.bytes.clone();
    raw.extend_from_slice(NEXT);
    let ours = read_with_h1(&raw);
    let Some(first) = ours.first() else {
        return Ok(Outcome::Refused);
    };
    let shown = request.bytes.escape_ascii().to_string();
    prop_assert_eq!(
        ours.len(),
        2,
        "kvmesh-h1 read the next request too: {}",
        shown
    );
    prop_assert_eq!(&ours[1].target, "/next");
    let (theirs, error) = runtime.block_on(read_with_hyper(&raw));
    if theirs.is_empty() && error.as_deref().is_some_and(|error| exempt(request, error)) {
        return Ok(Outcome::Exempt);
    }
    let expected = if request.http10 {
        &ours[..1]
    } else {
        &ours[..]
    };
    prop_assert!(
        theirs.len() >= expected.len(),
        "hyper read {} requests ({:?}) where kvmesh-h1 read {}: {}",
        theirs.len(),
        error,
        expected.len(),
        shown
    );
    prop_assert_eq!(&theirs[..expected.len()], expected, "{}", shown);
    prop_assert_eq!(&first.method, &request.method);
    Ok(Outcome::Same)
}

/// A generated request, and what it was made of.
#[derive(Clone)]
struct Generated {
    /// The request's bytes.
    bytes: Vec<u8>,
    /// Its target, as sent.
    target: Vec<u8>,
    /// Its `Content-Length` is a list (`5, 5`).
    length_list: bool,
    method: String,
    http10: bool,
}

impl std::fmt::Debug for Generated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "\"{}\"", self.bytes.escape_ascii())
    }
}

/// Token characters (RFC 9110 §5.6.2).
const TCHAR: &[u8] =
    b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";

fn token(max: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(TCHAR), 1..max)
        .prop_map(|bytes| String::from_utf8(bytes).unwrap_or_default())
}

fn method() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec!["POST", "GET", "PUT", "DELETE", "OPTIONS", "PATCH"])
            .prop_map(str::to_owned),
        1 => token(12),
    ]
}

/// What a path and query hold as RFC 3986 writes them: unreserved and sub-delims characters,
/// `:`, `@`, `/`, `?` and `%` (an escape, or not).
const PCHAR: &[u8] = b"abcxyzABCXYZ0189-._~!$&'()*+,;=:@/?%";

/// Visible characters RFC 3986 wants escaped in a path and query, and `#`.
const UNSAFE: &[u8] = b"\"<>\\^`{|}[]#";

/// A target: origin form (mostly of [`PCHAR`], sometimes with [`UNSAFE`] characters),
/// absolute form (with the authority the `Host` field must repeat), or `*`.
fn target() -> impl Strategy<Value = (String, Option<String>)> {
    let byte = prop_oneof![60 => prop::sample::select(PCHAR), 1 => prop::sample::select(UNSAFE)];
    let path = prop::collection::vec(byte, 0..24)
        .prop_map(|bytes| format!("/{}", String::from_utf8(bytes).unwrap_or_default()));
    let authority = (
        prop::sample::select(vec!["a", "engine.local", "127.0.0.1", "[::1]", "a-b.c"]),
        prop::option::of(1u16..),
    )
        .prop_map(|(host, port)| match port {
            Some(port) => format!("{host}:{port}"),
            None => host.to_owned(),
        });
    prop_oneof![
        6 => path.clone().prop_map(|path| (path, None)),
        2 => (prop::sample::select(vec!["http", "https", "HTTP"]), authority, prop::option::of(path))
            .prop_map(|(scheme, authority, path)| {
                (format!("{scheme}://{authority}{}", path.unwrap_or_default()), Some(authority))
            }),
        1 => Just(("*".to_owned(), None)),
    ]
}

/// A field value: visible ASCII, blanks inside and around, obs-text.
fn value() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop_oneof![
        8 => 0x21u8..0x7f,
        1 => Just(b' '),
        1 => Just(b'\t'),
        1 => 0x80u8..=0xff,
    ];
    (
        prop::sample::select(vec!["", " ", "\t", "  "]),
        prop::collection::vec(byte, 0..30),
        prop::sample::select(vec!["", " ", "\t"]),
    )
        .prop_map(|(before, value, after)| {
            let mut out = before.as_bytes().to_vec();
            out.extend_from_slice(&value);
            out.extend_from_slice(after.as_bytes());
            out
        })
}

/// A field that says nothing of framing or of the connection.
fn other_field() -> impl Strategy<Value = (String, Vec<u8>)> {
    (token(16), value()).prop_filter("no framing or connection field", |(name, _)| {
        let name = name.to_ascii_lowercase();
        !matches!(
            name.as_str(),
            "host"
                | "content-length"
                | "transfer-encoding"
                | "connection"
                | "keep-alive"
                | "upgrade"
                | "expect"
                | "te"
                | "trailer"
        ) && !name.contains('_')
    })
}

/// How the body is framed.
#[derive(Debug, Clone)]
enum Framing {
    None,
    /// `Content-Length`: the field lines (`{n}` stands for the length).
    Length(Vec<&'static str>),
    /// Chunked: the coding's spelling, each chunk (size line's form, extension), trailers.
    Chunked {
        coding: &'static str,
        chunks: Vec<(u8, String)>,
        trailers: Vec<(String, Vec<u8>)>,
    },
}

fn extension() -> impl Strategy<Value = String> {
    let quoted = prop::collection::vec(
        prop_oneof![
            8 => prop::sample::select(TCHAR).prop_map(|b| vec![b]),
            1 => Just(b" ".to_vec()),
            1 => Just(b"\\\"".to_vec()),
            1 => Just(b";,=".to_vec()),
        ],
        0..8,
    )
    .prop_map(|parts| {
        format!(
            "\"{}\"",
            String::from_utf8(parts.concat()).unwrap_or_default()
        )
    });
    let value = prop_oneof![token(8), quoted];
    prop::collection::vec(
        (
            prop::sample::select(vec!["", " "]),
            token(8),
            prop::option::of(value),
        ),
        0..3,
    )
    .prop_map(|extensions| {
        extensions
            .into_iter()
            .map(|(blank, name, value)| match value {
                Some(value) => format!("{blank};{name}={value}"),
                None => format!("{blank};{name}"),
            })
            .collect()
    })
}

fn framing() -> impl Strategy<Value = Framing> {
    prop_oneof![
        1 => Just(Framing::None),
        3 => prop_oneof![
            6 => prop::sample::select(vec![
                vec!["{n}"],
                vec![" {n} "],
                vec!["\t{n}"],
                vec!["00{n}"],
                vec!["{n}", "{n}"],
            ]),
            1 => prop::sample::select(vec![vec!["{n}, {n}"], vec!["{n},{n}"]]),
        ]
        .prop_map(Framing::Length),
        4 => (
            prop::sample::select(vec!["chunked", "Chunked", "CHUNKED", " chunked "]),
            prop::collection::vec((any::<u8>(), extension()), 0..4),
            prop::collection::vec(other_field(), 0..3),
        )
            .prop_map(|(coding, chunks, trailers)| Framing::Chunked { coding, chunks, trailers }),
    ]
}

prop_compose! {
    fn request()(
        method in method(),
        (target, authority) in target(),
        http10 in prop::bool::weighted(0.15),
        host in prop::bool::weighted(0.97),
        fields in prop::collection::vec(other_field(), 0..8),
        framing in framing(),
        body in prop::collection::vec(any::<u8>(), 0..200),
        bare_lf in prop::collection::vec(prop::bool::weighted(0.15), 16),
    ) -> Generated {
        let line_end = |i: usize| if bare_lf[i % bare_lf.len()] { "\n" } else { "\r\n" };
        let mut raw = format!("{method} {target} HTTP/1.{}{}", u8::from(!http10), line_end(0))
            .into_bytes();
        let mut line = 1;
        let mut field = |raw: &mut Vec<u8>, name: &str, value: &[u8]| {
            raw.extend_from_slice(name.as_bytes());
            raw.extend_from_slice(b":");
            raw.extend_from_slice(value);
            raw.extend_from_slice(line_end(line).as_bytes());
            line += 1;
        };
        if host {
            let host = authority.unwrap_or_else(|| "a".to_owned());
            field(&mut raw, "Host", format!(" {host}").as_bytes());
        }
        for (name, value) in &fields {
            field(&mut raw, name, value);
        }
        // Transfer-Encoding is refused on HTTP/1.0 (RFC 9112 §6.1): such requests are framed
        // by their length instead.
        let framing = match framing {
            Framing::Chunked { .. } if http10 => Framing::Length(vec!["{n}"]),
            framing => framing,
        };
        let mut encoded = Vec::new();
        match &framing {
            Framing::None => {}
            Framing::Length(lines) => {
                for value in lines {
                    let value = value.replace("{n}", &body.len().to_string());
                    field(&mut raw, "Content-Length", format!(" {value}").as_bytes());
                }
                encoded.extend_from_slice(&body);
            }
            Framing::Chunked { coding, chunks, trailers } => {
                field(&mut raw, "Transfer-Encoding", format!(" {coding}").as_bytes());
                let mut rest = &body[..];
                for (i, (form, extension)) in chunks.iter().enumerate() {
                    let size = if i + 1 == chunks.len() {
                        rest.len()
                    } else {
                        rest.len().min(usize::from(*form) % 64)
                    };
                    if size == 0 {
                        continue;
                    }
                    let (data, after) = rest.split_at(size);
                    rest = after;
                    let digits = match form % 3 {
                        0 => format!("{size:x}"),
                        1 => format!("{size:X}"),
                        _ => format!("000{size:x}"),
                    };
                    encoded.extend_from_slice(format!("{digits}{extension}\r\n").as_bytes());
                    encoded.extend_from_slice(data);
                    encoded.extend_from_slice(b"\r\n");
                }
                encoded.extend_from_slice(b"0\r\n");
                for (name, value) in trailers {
                    encoded.extend_from_slice(name.as_bytes());
                    encoded.extend_from_slice(b":");
                    encoded.extend_from_slice(value);
                    encoded.extend_from_slice(b"\r\n");
                }
                encoded.extend_from_slice(b"\r\n");
            }
        }
        raw.extend_from_slice(line_end(line).as_bytes());
        raw.extend_from_slice(&encoded);
        let length_list = matches!(&framing, Framing::Length(lines) if lines.iter().any(|line| line.contains(',')));
        Generated { bytes: raw, target: target.into_bytes(), length_list, method, http10 }
    }
}

#[test]
fn every_request_kvmesh_h1_accepts_hyper_reads_the_same() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let cases = 4000;
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let outcomes = std::cell::RefCell::new(Vec::new());
    let run = runner.run(&request(), |request| {
        outcomes.borrow_mut().push(compare(&runtime, &request)?);
        Ok(())
    });
    if let Err(failure) = run {
        panic!("{failure}");
    }
    let outcomes = outcomes.into_inner();
    let same = outcomes
        .iter()
        .filter(|&&outcome| outcome == Outcome::Same)
        .count();
    let exempt = outcomes
        .iter()
        .filter(|&&outcome| outcome == Outcome::Exempt)
        .count();
    eprintln!(
        "{} requests: {same} read the same, {exempt} refused by hyper (exempt), {} refused by kvmesh-h1",
        outcomes.len(),
        outcomes.len() - same - exempt
    );
    // Not vacuous: most requests are compared, and the exemption is met (it is not dead).
    assert!(
        same * 10 >= outcomes.len() * 8 && exempt > 0,
        "of {} requests, {same} compared and {exempt} exempt",
        outcomes.len()
    );
}
