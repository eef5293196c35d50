"""Free ports on 127.0.0.1 for tests that start servers or ranks."""

import socket


def free_port():
    """A port free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n):
    """The first of n consecutive free ports (mlx.launch's ring backend listens on port + rank)."""
    for _ in range(50):
        port = free_port()
        if port + n < 65536 and all(port_is_free(port + i) for i in range(n)):
            return port
    raise RuntimeError("no free loopback ports")
