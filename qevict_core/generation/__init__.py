"""Running caches: the lockstep decode loop, prefill whole or in chunks, shared forwards, padded batches."""
