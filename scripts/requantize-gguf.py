"""Write a copy of a GGUF whose decoder matrices are re-quantized to another GGUF type: a model
of a given source type (Q8_0, F16, ...) to measure eyas's precisions on, where only other types
ship. Metadata (config, tokenizer, chat template) and every other tensor are copied as they are.

    python scripts/requantize-gguf.py MODEL_OR_GGUF OUT.gguf [TYPE]     # TYPE default Q8_0

MODEL_OR_GGUF: a .gguf file or an alias (smollm2-135m). The values written are the source's
dequantized values quantized with gguf.quants (so a Q4_1 source becomes the Q8_0 model closest
to it, not the original float model).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def requantize(source: Path, out: Path, kind: str = "Q8_0") -> Path:
    import gguf

    reader = gguf.GGUFReader(str(source))
    target = gguf.GGMLQuantizationType[kind]
    architecture = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(out), architecture)
    for field in reader.fields.values():  # 1. metadata, as gguf's own gguf_new_metadata.py copies it
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:  # 2. decoder matrices re-quantized, the rest copied
        if tensor.name.startswith("blk.") and len(tensor.shape) == 2:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, target), raw_dtype=target)
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    spec, out = sys.argv[1], Path(sys.argv[2])
    source = Path(spec)
    if source.suffix != ".gguf":
        from eyas.models.registry import resolve_model
        from eyas.models.weight_source import gguf_file

        source = gguf_file(resolve_model(spec))
    requantize(source, out, sys.argv[3] if len(sys.argv) == 4 else "Q8_0")
    print(f"wrote {out} ({out.stat().st_size / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
