"""Entry points; installed as ``distribuuuu.tools`` (see setup.py)."""
