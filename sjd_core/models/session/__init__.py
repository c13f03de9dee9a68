"""What a decoding session is made of, one concern per module.

* :mod:`.token_layout`: where each fed token sits (structural tokens, sequence positions, cache
  columns), planned on the host;
* :mod:`.kv_store`: the preallocated key/value cache, written and compacted in place;
* :mod:`.mask_buffer`: the persistent attention mask, updated only where a forward changes it;
* :mod:`.slot_session`: the session contract built from them, which the transformers
  session (:mod:`..hf_session`) and the synthetic model's session specialise; its network
  runs compiled through :mod:`sjd_core.compiled` where asked.
"""
