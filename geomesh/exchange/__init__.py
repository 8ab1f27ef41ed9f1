"""The running exchange: placement of a job's ranks, transports, torchft membership and regions."""

import os

# Before any module here imports torchft: its Rust side logs every quorum at info.
os.environ.setdefault("RUST_LOG", "error")
