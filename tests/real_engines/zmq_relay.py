"""A ZMQ relay between a vLLM engine's KV event publisher and its agent, which the test can
cut (SIGUSR1: every message is dropped from then on) and restore (SIGUSR2): KV events lost
between the engine and the agent, with nothing else disturbed.

Run with the vLLM environment's Python (it has pyzmq): `zmq_relay.py UPSTREAM PORT`. It
prints `ready`, `cut` and `restored` as it reaches each state, and `dropped N` per drop.
"""

import signal
import sys

import zmq


def main():
    upstream, port = sys.argv[1], int(sys.argv[2])
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(upstream)
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    state = {"forwarding": True, "dropped": 0}

    def cut(*_):
        state["forwarding"] = False
        print("cut", flush=True)

    def restore(*_):
        state["forwarding"] = True
        print("restored", flush=True)

    signal.signal(signal.SIGUSR1, cut)
    signal.signal(signal.SIGUSR2, restore)
    print("ready", flush=True)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while True:
        # A bounded poll, so a signal is handled within 100 ms even while nothing arrives.
        if not poller.poll(100):
            continue
        parts = sub.recv_multipart()
        if state["forwarding"]:
            pub.send_multipart(parts)
        else:
            state["dropped"] += 1
            print(f"dropped {state['dropped']}", flush=True)


if __name__ == "__main__":
    main()
