"""avatar: render talking-avatar videos of any length from a reference picture and a speech track."""

__version__ = "0.1.0"
