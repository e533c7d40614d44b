"""Speculative decoding: proposers (n-gram prompt lookup, draft model), the rejection sampler that verifies their
drafts in one target forward, and the adaptive rule that decides when speculation pays. docs/SPECULATIVE.md."""
