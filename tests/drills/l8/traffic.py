"""L8's traffic."""
traffic = rows_read_before_window = None
