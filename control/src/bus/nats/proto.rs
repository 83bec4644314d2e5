//! The NATS client protocol, text form: parsing what the server sends (`INFO`, `MSG`, `PING`,
//! `PONG`, `+OK`, `-ERR`) and encoding what the client sends (`CONNECT`, `PUB`, `SUB`, `UNSUB`,
//! `PING`, `PONG`).

use bytes::{BufMut, Bytes, BytesMut};

/// A control line longer than this without `\r\n` is a protocol error.
const MAX_CONTROL_LINE: usize = 64 * 1024;

/// An operation received from the server.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ServerOp {
    /// Server information; carries the JSON's `max_payload` when present.
    Info {
        /// Largest payload the server accepts.
        max_payload: Option<usize>,
    },
    /// A message for subscription `sid`.
    Msg {
        subject: String,
        sid: u64,
        reply: Option<String>,
        payload: Bytes,
    },
    /// Keep-alive probe: answer `PONG`.
    Ping,
    /// Answer to our `PING`.
    Pong,
    /// Acknowledgement (verbose mode).
    Ok,
    /// An error; the server closes the connection after most of them.
    Err(String),
}

/// The server broke the protocol.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ProtocolError(pub String);

fn protocol_error<T>(what: impl Into<String>) -> Result<T, ProtocolError> {
    Err(ProtocolError(what.into()))
}

/// Takes one complete operation off the front of `buf`; `Ok(None)` when more bytes are needed.
pub(crate) fn parse(buf: &mut BytesMut) -> Result<Option<ServerOp>, ProtocolError> {
    let Some(end) = buf.windows(2).position(|w| w == b"\r\n") else {
        if buf.len() > MAX_CONTROL_LINE {
            return protocol_error("control line too long");
        }
        return Ok(None);
    };
    let line = match std::str::from_utf8(&buf[..end]) {
        Ok(line) => line,
        Err(_) => return protocol_error("control line is not UTF-8"),
    };
    let (op, args) = line.split_once([' ', '\t']).unwrap_or((line, ""));
    let parsed = match op.to_ascii_uppercase().as_str() {
        "MSG" => {
            let parts: Vec<&str> = args.split_ascii_whitespace().collect();
            let (subject, sid, reply, size) = match parts.as_slice() {
                [subject, sid, size] => (*subject, *sid, None, *size),
                [subject, sid, reply, size] => (*subject, *sid, Some(*reply), *size),
                _ => return protocol_error(format!("bad MSG line {line:?}")),
            };
            let (Ok(sid), Ok(size)) = (sid.parse::<u64>(), size.parse::<usize>()) else {
                return protocol_error(format!("bad MSG line {line:?}"));
            };
            let total = end + 2 + size + 2;
            if buf.len() < total {
                return Ok(None);
            }
            let subject = subject.to_owned();
            let reply = reply.map(str::to_owned);
            let mut frame = buf.split_to(total);
            frame.truncate(total - 2);
            let payload = frame.split_off(end + 2).freeze();
            return Ok(Some(ServerOp::Msg {
                subject,
                sid,
                reply,
                payload,
            }));
        }
        "PING" => ServerOp::Ping,
        "PONG" => ServerOp::Pong,
        "+OK" => ServerOp::Ok,
        "-ERR" => ServerOp::Err(args.trim().trim_matches('\'').to_owned()),
        "INFO" => {
            let info: serde_json::Value = match serde_json::from_str(args) {
                Ok(info) => info,
                Err(e) => return protocol_error(format!("bad INFO: {e}")),
            };
            let max_payload = info["max_payload"]
                .as_u64()
                .and_then(|v| usize::try_from(v).ok());
            ServerOp::Info { max_payload }
        }
        _ => return protocol_error(format!("unknown operation {op:?}")),
    };
    let _ = buf.split_to(end + 2);
    Ok(Some(parsed))
}

/// The `CONNECT` line (no auth, no headers, no echo suppression) followed by a `PING`.
pub(crate) fn connect_lines(name: &str) -> Vec<u8> {
    let connect = serde_json::json!({
        "verbose": false,
        "pedantic": false,
        "tls_required": false,
        "name": name,
        "lang": "rust",
        "version": env!("CARGO_PKG_VERSION"),
        "protocol": 1,
        "echo": true,
        "headers": false,
    });
    format!("CONNECT {connect}\r\nPING\r\n").into_bytes()
}

/// Appends `PUB subject [reply] size\r\npayload\r\n`.
pub(crate) fn write_pub(out: &mut BytesMut, subject: &str, reply: Option<&str>, payload: &[u8]) {
    out.reserve(subject.len() + payload.len() + 40);
    out.put_slice(b"PUB ");
    out.put_slice(subject.as_bytes());
    if let Some(reply) = reply {
        out.put_u8(b' ');
        out.put_slice(reply.as_bytes());
    }
    out.put_u8(b' ');
    out.put_slice(payload.len().to_string().as_bytes());
    out.put_slice(b"\r\n");
    out.put_slice(payload);
    out.put_slice(b"\r\n");
}

/// Appends `SUB subject sid\r\n`.
pub(crate) fn write_sub(out: &mut BytesMut, subject: &str, sid: u64) {
    out.put_slice(format!("SUB {subject} {sid}\r\n").as_bytes());
}

/// Appends `UNSUB sid\r\n`.
pub(crate) fn write_unsub(out: &mut BytesMut, sid: u64) {
    out.put_slice(format!("UNSUB {sid}\r\n").as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(input: &[u8]) -> Vec<ServerOp> {
        let mut buf = BytesMut::from(input);
        let mut ops = Vec::new();
        while let Some(op) = parse(&mut buf).expect("valid protocol") {
            ops.push(op);
        }
        assert!(buf.is_empty(), "left over: {buf:?}");
        ops
    }

    #[test]
    fn server_operations_parse() {
        let ops = parse_all(
            b"INFO {\"server_id\":\"x\",\"max_payload\":1048576}\r\nPING\r\nPONG\r\n+OK\r\n\
              MSG a.b 7 5\r\nhello\r\nMSG a.c 8 _INBOX.x 2\r\nhi\r\nMSG e 9 0\r\n\r\n\
              -ERR 'Unknown Protocol Operation'\r\n",
        );
        assert_eq!(
            ops,
            vec![
                ServerOp::Info {
                    max_payload: Some(1_048_576)
                },
                ServerOp::Ping,
                ServerOp::Pong,
                ServerOp::Ok,
                ServerOp::Msg {
                    subject: "a.b".into(),
                    sid: 7,
                    reply: None,
                    payload: Bytes::from_static(b"hello"),
                },
                ServerOp::Msg {
                    subject: "a.c".into(),
                    sid: 8,
                    reply: Some("_INBOX.x".into()),
                    payload: Bytes::from_static(b"hi"),
                },
                ServerOp::Msg {
                    subject: "e".into(),
                    sid: 9,
                    reply: None,
                    payload: Bytes::new(),
                },
                ServerOp::Err("Unknown Protocol Operation".into()),
            ]
        );
    }

    #[test]
    fn partial_input_waits_for_more() {
        let whole = b"MSG a.b 1 10\r\n0123456789\r\n";
        for cut in 1..whole.len() {
            let mut buf = BytesMut::from(&whole[..cut]);
            assert_eq!(parse(&mut buf), Ok(None), "cut at {cut}");
            assert_eq!(buf.len(), cut, "nothing consumed at {cut}");
            buf.extend_from_slice(&whole[cut..]);
            assert!(matches!(parse(&mut buf), Ok(Some(ServerOp::Msg { .. }))));
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn garbage_is_a_protocol_error() {
        for bad in [
            &b"WHAT\r\n"[..],
            b"MSG a\r\n",
            b"MSG a b c\r\n",
            b"INFO {\r\n",
        ] {
            assert!(parse(&mut BytesMut::from(bad)).is_err(), "{bad:?}");
        }
        let long = vec![b'x'; MAX_CONTROL_LINE + 1];
        assert!(parse(&mut BytesMut::from(&long[..])).is_err());
    }

    #[test]
    fn client_operations_encode() {
        let mut out = BytesMut::new();
        write_pub(&mut out, "a.b", None, b"xy");
        write_pub(&mut out, "a.b", Some("r.1"), b"");
        write_sub(&mut out, "a.*", 3);
        write_unsub(&mut out, 3);
        assert_eq!(
            &out[..],
            b"PUB a.b 2\r\nxy\r\nPUB a.b r.1 0\r\n\r\nSUB a.* 3\r\nUNSUB 3\r\n"
        );
        let connect = connect_lines("agent");
        assert!(connect.starts_with(b"CONNECT {") && connect.ends_with(b"}\r\nPING\r\n"));
    }
}
