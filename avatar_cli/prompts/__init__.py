"""Text encodings computed once: a content-addressed cache of a family's prompt conditioning, on disk.

Why: the wan-s2v family's umT5-XXL is 11.4 GB of weights used once per prompt, and bulk renders repeat a
handful of prompts across hundreds of jobs and hosts. A job whose prompt is in the cache never loads its text
encoder (the runner asks `cache.ready` before `ModelCache.get` and skips the prompt-only components).

A layer of its own, below the pipeline and the text service (avatar_cli/service/), one job per file:
- entry.py: an entry's key and format (safetensors bytes, the key and a data digest in its metadata), shared by
  the cache, the service and its client;
- identity.py: what names a model's prompt encodings (the family spec's prompt identity, the encoder's dtype
  and weights format);
- store.py: the folder of entries (`runtime.text_cache`), read verified and written atomically;
- cache.py: the read-through cache the prompt step uses (`PromptCache`), and the text service behind it;
- encode.py: `avatar prompts encode`, which fills the cache ahead of the renders.
"""
