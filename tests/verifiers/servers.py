"""A listening socket that answers every connection with a secret: what an attack program tries to reach."""

import contextlib
import threading


@contextlib.contextmanager
def answering(server, secret: bytes):
    """Serves ``secret`` to each connection to the listening ``server`` (a timeout set, so that it can stop) until
    the block ends; yields the list that counts the connections, then closes the server."""
    connections, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            connections.append(1)
            conn.sendall(secret)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield connections
    finally:
        stop.set()
        thread.join()
        server.close()
