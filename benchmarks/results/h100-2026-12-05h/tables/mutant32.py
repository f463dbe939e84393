"""Session 32: take out the act·mul kernels from the load's NVRTC pass (decoder and warmup), print the diff."""
import difflib
from pathlib import Path
edits = {"vlmctl/runtime/decoder.py": [("act_mul_shapes=gate_up_dims,", "act_mul_shapes=(),")],
         "vlmctl/runtime/kernels/w4a16.py": [("                                act_mul_shapes={(p[\"q4weight\"].shape[0]",
                                              "                                act_mul_shapes=() and {(p[\"q4weight\"].shape[0]")]}
for path, subs in edits.items():
    p = Path(path)
    old = p.read_text()
    new = old
    for a, b in subs:
        assert new.count(a) == 1, (path, a)
        new = new.replace(a, b)
    p.write_text(new)
    print("".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), path, path)))
