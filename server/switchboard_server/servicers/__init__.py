"""gRPC servicers: translate proto to domain calls and back. They hold no SQL."""
