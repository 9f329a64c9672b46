"""Plots and tables for people, from what the catalog computes (the catalog draws nothing).

One job per module:

- ``tables``: DataFrames as text, CSV or JSON, as the command line prints them;
- ``canvas``: the one place that makes and saves matplotlib figures (no pyplot);
- ``audit_plot``: :func:`~lakeloader.report.audit_plot.plot_audit`, a mixture's realized vs
  target share over a range of steps;
- ``lengths_plot``: :func:`~lakeloader.report.lengths_plot.plot_lengths`, a lake's document
  lengths per dataset.

The plots need matplotlib (``pip install matplotlib``), imported only when one is drawn; this
package imports none of its modules, so the command line loads only what a command uses.
"""
