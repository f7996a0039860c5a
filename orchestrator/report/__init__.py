"""Reports: rows per run, the sweep report (terminal, Markdown, HTML), plots, links, reading runs back."""
