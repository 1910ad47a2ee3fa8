"""`weightsync run`: a job's pods as local processes, with exactly the files and environment each
pod would get, a kubelet that probes and restarts them as Kubernetes would, and the memory check
that refuses a job this machine cannot hold."""
