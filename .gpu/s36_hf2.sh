export PYTHONPATH=.:tests:/tmp/site RTKERNELS_CACHE_DIR=/tmp/rtkc
pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl > /dev/null 2>&1
timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_torch_hf.py 2>&1 | tail -4
timeout 120 python3 examples/train_llama_rtk.py --steps 4 --packed --compare 2>&1 | tail -7
