"""The package layout and the prebuilt kernel library (the metadata is in pyproject.toml).

Each folder in PACKAGE_FOLDERS installs as ``kiln.<folder>`` with every folder below it; ``toplevel/``
installs as ``kiln`` itself (``kiln.LLM``; not a folder named ``kiln/``, which would shadow the installed
package for a Python started in the repository's root); every file under a data folder (``csrc/``: C++
sources and headers, ``templates/``: jinja2 templates) is package data. Adding a top-level package is one
line here (tests/test_packaging.py fails while a folder with an ``__init__.py`` is missing from the wheel).

The plugins' native library (``kiln/plugins/kiln_kernels.so``, the CPU kernels of every plugin op) is
compiled into the wheel when torch is importable in the build environment, so an installed kiln
starts without compiling anything. pyproject.toml's ``[build-system]`` requires ``torch==2.13.0``, so
pip's default isolated build has it too (the exact pin: any other spec pulls a multi-GB CUDA build)::

    pip install torch==2.13.0 && pip install .        # the kernels are compiled into what is installed

``pip wheel --no-build-isolation --no-deps -w dist .`` (``make wheel``) builds against the torch of the
current environment instead (no second torch to install). A wheel built where torch is not importable
has no prebuilt library: the kernels then compile on first use (~20 s, cached in TORCH_EXTENSIONS_DIR).
The library links against the torch it was built with; a different torch at run time compiles a fresh
one (see kiln/plugins/native.py).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).resolve().parent
PACKAGE_FOLDERS = ["contract", "clikit", "model_defs", "plugins", "builder", "runtime", "serving", "bench"]
TOP_FOLDER = "toplevel"   # the kiln package itself
DATA_FOLDERS = {"csrc", "templates"}  # every file below one of these is package data


def packages() -> tuple[list[str], dict[str, str], dict[str, list[str]]]:
    """Package names, their folders and their data files. Data folders are listed as (namespace)
    packages too: that is how setuptools ships a folder of non-Python files."""
    names, dirs, data = ["kiln"], {"kiln": TOP_FOLDER}, {}
    for folder in PACKAGE_FOLDERS:
        dirs[f"kiln.{folder}"] = folder
        names.append(f"kiln.{folder}")
        caches = ["__pycache__", "*.__pycache__", "*.__pycache__.*"]
        for sub in find_namespace_packages(str(ROOT / folder), exclude=caches):
            name = f"kiln.{folder}.{sub}"
            names.append(name)
            if DATA_FOLDERS & set(sub.split(".")):
                data[name] = ["*"]
    return names, dirs, data


def native_library() -> tuple[list, dict]:
    """The kernel library as a torch C++ extension, when torch is here to compile it against."""
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("setup.py: torch is not importable in this build environment; the wheel gets no prebuilt "
              "kernel library (the kernels compile on first use). pyproject.toml's build requirements include "
              "torch: build with pip's default isolation, or with torch installed and --no-build-isolation.",
              file=sys.stderr)
        return [], {}
    # the loader knows the sources, flags and build key; it imports only torch and the standard library
    spec = importlib.util.spec_from_file_location("kiln_native_loader", ROOT / "plugins" / "native.py")
    native = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = native  # dataclasses look their module up
    spec.loader.exec_module(native)
    ext = CppExtension(
        name=f"kiln.plugins.{native.LIBRARY_NAME}",
        sources=[str(p.relative_to(ROOT)) for p in native.SOURCES],
        extra_compile_args=[*native.CFLAGS, native.key_define(native.build_key())],
        extra_link_args=list(native.LDFLAGS),
    )
    # kiln_kernels.so, not a Python module name: the library is loaded with ctypes, never imported
    return [ext], {"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)}


# setuptools packs whatever lies in build/lib* into the wheel, modules deleted from the tree since the
# last build included: start each build from empty ones (the kernels' objects in build/temp* are kept,
# so an unchanged library only relinks).
for stale in ROOT.glob("build/lib*"):
    shutil.rmtree(stale)
names, dirs, data = packages()
ext_modules, cmdclass = native_library()
setup(
    packages=names,
    package_dir=dirs,
    package_data=data,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
