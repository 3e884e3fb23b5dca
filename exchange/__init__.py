"""The program ``exchange serve``: a stateless broker of orders on NATS (``service.py``:
``ExchangeService``, the order, machine and reclaim subjects; ``cli.py``: its options).
The auction it runs, and the wire contract, are the shared library's (``bourse.auction``,
``bourse.wire``)."""
