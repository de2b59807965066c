"""L8's picture."""
picture = draw_case = None
