"""A log of records in numbered segment files on local disk, appended with group-commit
``fsync``: the sending queue's and the intake's (``segments.py``, ``writer.py``)."""
