"""The commands of ``lit-titan``, one file each; the table is ``commands.py``. Nothing in the library imports cli/."""
