import shutil
from test_triton_repo import pythons, trtllm_engine  # noqa: F401


def test_scratch(trtllm_engine, pythons):
    shutil.rmtree("/tmp/audit", ignore_errors=True)
    shutil.copytree(trtllm_engine, "/tmp/audit/engine", symlinks=True)
    shutil.copytree(pythons["trt"].parent.parent, "/tmp/audit/py_trt", symlinks=True)
