"""Asks a KV event replay socket (vLLM's ZMQ ROUTER, or engine-sim's) for every batch from a
sequence number on and prints what came back as one JSON object: each reply's frames as the
DEALER received them, and each batch decoded from msgpack, maps staying objects and arrays
staying lists (so the encoding, map or positional, shows), bytes as {"bin": hex}.

Run with the vLLM environment's Python (it has pyzmq and msgspec):
`kv_replay_dump.py ENDPOINT START_SEQ TIMEOUT_S`.
"""

import json
import sys

import msgspec
import zmq

END_SEQ = b"\xff" * 8


def plain(value):
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"bin": bytes(value).hex()}
    if isinstance(value, dict):
        return {key: plain(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def main():
    endpoint, start, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    dealer = zmq.Context().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    # vLLM's replay request: an empty delimiter, then the first wanted sequence number.
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replies, ended = [], False
    while dealer.poll(int(timeout_s * 1000)):
        frames = dealer.recv_multipart()
        reply = {"frames": len(frames), "lengths": [len(f) for f in frames]}
        if END_SEQ in frames:
            reply["end"] = [f.hex() for f in frames]
            replies.append(reply)
            ended = True
            break
        # [empty delimiter, topic, seq (8 bytes BE), payload]
        reply["topic"] = frames[1].decode(errors="replace") if len(frames) == 4 else None
        reply["seq"] = int.from_bytes(frames[-2], "big")
        reply["batch"] = plain(msgspec.msgpack.decode(frames[-1]))
        replies.append(reply)
    print(json.dumps({"ended": ended, "replies": replies}))


if __name__ == "__main__":
    main()
