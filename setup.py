"""The C extensions (everything else is in pyproject.toml; setuptools' own `ext-modules` table there is still
experimental): the KV indexer's ingest hot path and the native engine's CPU kernels (OpenMP, so they run on
torch's own threads; no FMA contraction, so products round as torch's do; -Wno-psabi: the 16-float vectors of
inline helpers warn of an ABI they never cross). Optional: without a compiler the install goes on, and
router/indexer.py and engines/native/kernels.py run the same steps in Python and torch, with a warning."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("router._index", ["router/_index.c"], optional=True),
    Extension("dynamo_pd.engines.native._kernels", ["dynamo_pd/engines/native/_kernels.c"], optional=True,
              extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-Wno-psabi"],
              extra_link_args=["-fopenmp"]),
])
