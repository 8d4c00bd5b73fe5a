# staging of the accuracy sweep's inputs: each call copies its carried part to /root/keep/acc
mkdir -p /root/keep/acc && cp -r .gpu/acc/p*/. /root/keep/acc/ 2>/dev/null; ls -la /root/keep/acc; df -h /root | tail -1
