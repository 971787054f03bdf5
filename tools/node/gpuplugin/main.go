// gpuplugin: a fake GPU device plugin for Spillway's real-node test clusters.
//
// It registers a resource (nvidia.com/gpu) with the kubelet through the device plugin
// API v1beta1 (the k8s.io/kubelet version the kubelet is built from), advertises
// --count healthy devices named <id-prefix>-<i>, and on Allocate hands the container
// the env NVIDIA_VISIBLE_DEVICES=<ids> (and SPILLWAY_FAKE_GPUS=<ids>), so a pod can show
// which fake GPUs it got. Nothing is mounted: there is no GPU behind the ids.
//
// The kubelet removes every socket in its device-plugins directory when it starts; the
// plugin polls for that (its own socket gone, or the kubelet's socket replaced) and
// serves and registers again.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices []*pluginapi.Device
	known   map[string]bool
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, s grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	if err := s.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-s.Context().Done() // the devices never change
	return nil
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		for _, id := range c.DevicesIds {
			if !p.known[id] {
				return nil, fmt.Errorf("unknown device %q", id)
			}
		}
		ids := strings.Join(c.DevicesIds, ",")
		log.Printf("allocate %s", ids)
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": ids, "SPILLWAY_FAKE_GPUS": ids},
		})
	}
	return resp, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func inode(path string) uint64 {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return 0
	}
	return st.Ino
}

func serve(p *plugin, sock string) (*grpc.Server, error) {
	_ = os.Remove(sock)
	lis, err := net.Listen("unix", sock)
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go func() { _ = srv.Serve(lis) }()
	return srv, nil
}

func register(kubeletSock, endpoint, resource string) error {
	conn, err := grpc.NewClient("unix://"+kubeletSock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: endpoint, ResourceName: resource,
		Options: &pluginapi.DevicePluginOptions{},
	})
	return err
}

func main() {
	resource := flag.String("resource", "nvidia.com/gpu", "extended resource to advertise")
	count := flag.Int("count", 8, "devices to advertise")
	prefix := flag.String("id-prefix", "GPU-fake", "device ids are <id-prefix>-<i>")
	dir := flag.String("dir", pluginapi.DevicePluginPath, "the kubelet's device-plugins directory")
	flag.Parse()
	log.SetFlags(log.LstdFlags | log.Lmicroseconds)

	p := &plugin{known: map[string]bool{}}
	for i := 0; i < *count; i++ {
		id := fmt.Sprintf("%s-%d", *prefix, i)
		p.devices = append(p.devices, &pluginapi.Device{ID: id, Health: pluginapi.Healthy})
		p.known[id] = true
	}
	endpoint := "spillway-gpu.sock"
	sock := filepath.Join(*dir, endpoint)
	kubeletSock := filepath.Join(*dir, "kubelet.sock")

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	var srv *grpc.Server
	var registeredTo uint64
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		kubelet := inode(kubeletSock)
		if srv == nil || inode(sock) == 0 || (kubelet != 0 && kubelet != registeredTo) {
			if srv != nil {
				srv.Stop()
				srv = nil
			}
			registeredTo = 0
			if kubelet != 0 {
				s, err := serve(p, sock)
				if err != nil {
					log.Printf("serve %s: %v", sock, err)
				} else if err := register(kubeletSock, endpoint, *resource); err != nil {
					log.Printf("register with %s: %v", kubeletSock, err)
					s.Stop()
				} else {
					srv, registeredTo = s, kubelet
					log.Printf("registered %s: %d devices %s-0..%d at %s", *resource, *count, *prefix, *count-1, sock)
				}
			}
		}
		select {
		case <-stop:
			if srv != nil {
				srv.Stop()
			}
			_ = os.Remove(sock)
			return
		case <-tick.C:
		}
	}
}
