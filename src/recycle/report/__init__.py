"""Reports: text grids, Gantt charts, Chrome traces, plots and tables."""
