"""A TCP relay between an agent and nats-server that the test can cut and restore: KV event
batches lost on the way to the bus, with the agent none the wiser.

`tcp_relay.py UPSTREAM_HOST:PORT LISTEN_PORT` (standard library only). SIGUSR1 cuts: from
then on every byte the agent sends is dropped while its connection stays open (a partition
the client cannot see). SIGUSR2 restores: the cut connections are closed, so the client
reconnects (a half-sent message must not reach the server) and new connections are relayed
whole. It prints `ready`, `cut` and `restored` as it reaches each state, and
`dropped N` (bytes dropped so far) after each dropped read.
"""

import asyncio
import signal
import sys


async def main():
    host, _, port = sys.argv[1].rpartition(":")
    listen = int(sys.argv[2])
    state = {"cut": False, "dropped": 0, "open": set()}

    async def pipe(reader, writer, upstream):
        try:
            while data := await reader.read(65536):
                if upstream and state["cut"]:
                    state["dropped"] += len(data)
                    print(f"dropped {state['dropped']}", flush=True)
                    continue
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def serve(client_reader, client_writer):
        server_reader, server_writer = await asyncio.open_connection(host, int(port))
        state["open"].add(client_writer)
        await asyncio.gather(
            pipe(client_reader, server_writer, True),
            pipe(server_reader, client_writer, False),
        )
        state["open"].discard(client_writer)

    def cut():
        state["cut"] = True
        print("cut", flush=True)

    def restore():
        for writer in list(state["open"]):
            writer.transport.abort()
        state["cut"] = False
        print("restored", flush=True)

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, cut)
    loop.add_signal_handler(signal.SIGUSR2, restore)
    server = await asyncio.start_server(serve, "127.0.0.1", listen)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
