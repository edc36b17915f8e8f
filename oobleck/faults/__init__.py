"""Failures: node traces (``trace``), schedules built from ``failures.*`` (``schedule``) and the
injector that decides when each event is due (``injector``)."""
