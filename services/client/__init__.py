"""The genserve client: `Client` (blocking) and `AsyncClient` (asyncio), typed by the genserve.v1 stubs.

    from genserve.services.client import Client
    with Client("127.0.0.1:9000") as client:
        print(client.generate("The with statement", max_tokens=32).text)

Over TLS: `Client(address, tls=ClientTls(ca="ca.pem"))` (plus cert= and key= for mutual TLS).
"""

from .aio import AsyncClient
from .errors import GenserveError
from .sync import DEFAULT_ADDRESS, Client
from .tls import ClientTls

__all__ = ["DEFAULT_ADDRESS", "AsyncClient", "Client", "ClientTls", "GenserveError"]
