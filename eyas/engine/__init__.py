"""The inference engine: target loading, sampling, plain and speculative decoding."""
