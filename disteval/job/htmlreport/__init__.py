"""REPORT (HTML): self-contained pages of a finished run (RUN_DIR/report.html), a sweep (SWEEP_DIR/report.html) and
the doctor's diagnosis (RUN_DIR/doctor/report.html). One file each, no network: inline CSS, figures as
base64-embedded PNGs drawn with matplotlib, pages from jinja2 templates (package data in ``templates/``). This
package reads records and draws; it imports neither torch nor any task (a task's figures are handed in)."""
from disteval.job.htmlreport.doctor import write_doctor_report
from disteval.job.htmlreport.run import write_run_report
from disteval.job.htmlreport.sweep import write_sweep_report

__all__ = ["write_run_report", "write_sweep_report", "write_doctor_report"]
