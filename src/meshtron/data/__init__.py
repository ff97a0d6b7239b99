"""Where training tokens come from: text (bytes or a tokenizer), Megatron-LM indexed token datasets,
and blends of them; batches sharded over ``data``, deterministic and resumable."""

from meshtron.data.text import BUILTIN_SOURCE, BatchStream, Corpus, builtin_text, heldout_stream, load_text

__all__ = ["BUILTIN_SOURCE", "BatchStream", "Corpus", "builtin_text", "heldout_stream", "load_text"]
