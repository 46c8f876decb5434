"""Reading runs after the fact: ``python -m hookexp.analysis.report`` (tables and curves of a sweep, the
coordinate check), ``python -m hookexp.analysis.ablate`` (a leave-one-out ablation) and the plots both draw."""
