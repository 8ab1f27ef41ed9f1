"""The wire format: canonical messages, their codecs, envelopes and the checks every message passes."""
