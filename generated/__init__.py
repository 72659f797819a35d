"""Generated backends (``symattn generate``); every module here is written by symattn."""
