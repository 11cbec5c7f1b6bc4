set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi -L
python3 -m pytest tests/torch/test_gpu.py -m gpu -n 4 -q -p no:cacheprovider 2>&1 | tail -8
mkdir -p $OUT
( time python3 -m crosstrain.cli tune src/crosstrain/testing/zoo_plans/gpt2_small.toml --batch --backend torch --out /tmp/tuneb --set "data.source='python-stdlib'" --set data.limit=3000 --write $OUT/gpt2_tuned.toml ) 2>&1 | tail -25
python3 -m crosstrain.cli tune examples/digits_mlp.toml --lr --backend torch --device gpu --out /tmp/tunelr 2>&1 | tail -4
