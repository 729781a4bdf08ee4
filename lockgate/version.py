"""The installed package's version (from its metadata), for ``--version``, TGI's ``/info`` and logs."""

from importlib.metadata import PackageNotFoundError, version


def _installed() -> str:
    try:
        return version("lockgate")
    except PackageNotFoundError:
        return "unknown"


__version__ = _installed()
