"""The running exchange: placement of a job's ranks, transports, torchft membership and regions."""
