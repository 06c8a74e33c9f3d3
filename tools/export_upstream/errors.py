"""Why an export was refused or failed. Every refusal happens before the checkout changes; a
failure half-way puts the checkout back as it was."""

from __future__ import annotations


class ExportError(Exception):
    """The series cannot be made on this checkout (the message says why)."""


class NotACheckoutError(ExportError):
    """The path is not a git checkout of torchdata."""


class UnsupportedVersionError(ExportError):
    """The checkout is a torchdata release the series is not made for."""


class DirtyCheckoutError(ExportError):
    """The checkout has uncommitted changes, or already has the branch."""


class ManifestError(ExportError):
    """``series.toml`` does not fit this repository: a module or test placed twice or not at all,
    a module exported before one it imports, an upstream file that does not exist."""


class UpstreamLayoutError(ExportError):
    """An upstream file does not look as the series expects (a name it replaces is missing)."""


class SourceNotFoundError(ExportError):
    """The exporter is not run from a clone of this repository (its tests and docs are missing)."""


class ToolMissingError(ExportError):
    """A tool the series needs (the formatter upstream pins) is not installed."""
