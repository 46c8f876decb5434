# Makes this folder a package so the configs ship inside the wheel as hookexp.conf.
