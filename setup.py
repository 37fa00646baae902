"""The one C extension, the KV indexer's ingest hot path (everything else is in pyproject.toml; setuptools'
own `ext-modules` table there is still experimental). Optional: without a compiler the install goes on and
router/indexer.py runs the same function in Python, with a warning."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("router._index", ["router/_index.c"], optional=True)])
